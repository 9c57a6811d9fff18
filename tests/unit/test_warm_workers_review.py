"""Ray-free review tests of warm workers and the package's lazy public names: a driver
that disconnects and joins the same cluster again (same node id, a new Ray job id) must
prestart workers for its new job, and ``import rayflow`` keeps its submodules reachable
as attributes, as it did before the public names became lazy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rayflow.runtime.warm_workers import WarmWorkerConfig, WarmWorkers
from tests.unit.test_warm_workers import FakeCalls, FakeNode


class JobRaylet:
    """A raylet handle made for the Ray job the driver is connected to at that moment."""

    def __init__(self, node: FakeNode, job_id: str) -> None:
        self.job_id = job_id
        self.startup_concurrency = node.concurrency
        self.prestarted_for: list[str] = []
        calls = self

        class Calls(FakeCalls):
            def prestart(self, n: int, keep_alive_s: float) -> None:
                calls.prestarted_for.append(calls.job_id)
                super().prestart(n, keep_alive_s)

        self.c = Calls(node)

    def calls(self) -> FakeCalls:
        return self.c


def test_a_driver_that_joins_the_same_cluster_again_prestarts_for_its_new_job():
    # ray.init(address=<cluster>); job; ray.shutdown(); ray.init(address=<cluster>); job.
    # The node id stays the same, the Ray job id does not: workers prestarted for the
    # first (finished) job id are refused by the raylet or bound to a job nobody runs.
    node = FakeNode(idle=0, concurrency=2, ticks=1)
    connection = {"job": "01000000"}
    made: list[JobRaylet] = []

    def factory() -> JobRaylet:
        made.append(JobRaylet(node, connection["job"]))
        return made[-1]

    warm = WarmWorkers(factory, node_id=lambda: "same-node")
    config = WarmWorkerConfig(max_workers=4, keep_alive_s=60)
    warm.keep_warm(4, config).join(30)

    connection["job"] = "02000000"  # ray.shutdown(); ray.init(address=<same cluster>)
    node.idle_now = 0  # the first job's workers went with its driver
    warm.keep_warm(4, config).join(30)

    asked_for = [job for raylet in made for job in raylet.prestarted_for]
    assert asked_for[-1] == "02000000", f"prestarted for {asked_for}"


@pytest.mark.parametrize("submodule", ["sources", "sink", "config", "errors", "state"])
def test_import_rayflow_keeps_its_submodules_reachable(submodule):
    # ``import rayflow; rayflow.sources.FileSource`` worked while the package imported
    # its modules eagerly
    code = f"import rayflow; rayflow.{submodule}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1]
