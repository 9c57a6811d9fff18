"""The marks a run's two-phase-commit sinks hold in their targets while the run lives.

Some sinks refuse to run next to another live run of the same job name, found in the
target itself (a run on another Ray cluster does not see this cluster's run lock): their
subtasks' sessions say so while they are connected. Between two attempts no subtask is
connected, so the job master holds each such sink's mark for the whole run
(:meth:`rayflow.sink.TwoPhaseCommittingSink.hold_run`), from before the first attempt
until the run is over and cleaned up.
"""

from __future__ import annotations

import logging

from rayflow.plan.physical import JobGraph
from rayflow.runtime.settings import JobSettings
from rayflow.sink import RunHold, SinkContext, TwoPhaseCommittingSink

__all__ = ["hold_sinks", "release_holds"]

log = logging.getLogger("rayflow.job")


def hold_sinks(graph: JobGraph, settings: JobSettings) -> list[RunHold]:
    """Take the mark of every two-phase-commit sink of ``graph`` for run
    ``settings.run_id``; raises what a sink raises (another run lives), after letting go
    of the marks taken so far. Blocking: call it in a thread."""
    holds: list[RunHold] = []
    try:
        for vertex in graph.vertices.values():
            for spec in vertex.operators:
                if not isinstance(spec.sink, TwoPhaseCommittingSink):
                    continue
                resolution = spec.guarantee
                context = SinkContext(
                    job_name=settings.job_name,
                    operator_uid=spec.uid,
                    subtask_index=0,
                    parallelism=vertex.parallelism,
                    attempt=-1,
                    run_id=settings.run_id,
                    delivery_guarantee=(
                        resolution.delivery_guarantee if resolution is not None else None
                    ),
                    operator_name=spec.name,
                )
                hold = spec.sink.hold_run(context)
                if hold is not None:
                    holds.append(hold)
    except BaseException:
        release_holds(holds)
        raise
    return holds


def release_holds(holds: list[RunHold]) -> None:
    """Let every mark go (never raises)."""
    for hold in holds:
        try:
            hold.close()
        except Exception as exc:  # noqa: BLE001 - the run is over either way
            log.warning("could not let go of a sink's run mark: %s", exc)
