"""The chaos runner (tests/chaos/run_chaos.py) in CI: a few seeds of its per-seed check,
in this process, on the session's Ray (tests/conftest.py starts it).

Each seed draws faults from every point of the protocol (``ALL_RANDOM_POINTS``) and
checks 0 lost, 0 duplicated, 0 open transactions, no actor left. The coins are fixed
here so that both extra schedules run: an earlier run of the same job name in the same
checkpoint storage, and a cancel after the first checkpoint followed by a resume from
``restore_from="latest"``. ``python tests/chaos/run_chaos.py`` runs many more seeds.
"""

from __future__ import annotations

import pytest

from tests.chaos.run_chaos import run_seed

N = 100_000  # about half a second of input per attempt at the runner's rate


@pytest.mark.chaos
@pytest.mark.parametrize(
    "seed, sink, rerun, cancel",
    [
        (3, "collect", False, True),
        (5, "collect", True, False),
        (7, "files", True, False),
    ],
)
def test_chaos_runner_seed_is_exactly_once(seed, sink, rerun, cancel, tmp_path):
    result = run_seed(seed, sink, n=N, workdir=tmp_path, rerun=rerun, cancel=cancel)
    print(result.line())
    assert result.ok, result.report()
    assert result.rows == result.expected_rows
