"""The watermark a restored subtask resumes from, when the old subtasks' snapshots differ
in whether they hold event time at all (an unaligned checkpoint taken while one subtask's
first watermark was still in flight, with records before it, as channel state): a
subtask without event time stood at the minimum, and must resume there, else it would
judge the records of its channel state late against another subtask's watermark."""

from __future__ import annotations

from types import SimpleNamespace

from rayflow.eventtime import MIN_WATERMARK
from rayflow.eventtime.valve import EVENT_TIME_KEY, ValveState
from rayflow.runtime.restore import StateHandle
from rayflow.runtime.subtask import Subtask

restored_event_time = Subtask._restored_event_time


def handles(parallelism, watermarks):
    """One snapshot per old subtask; None: that subtask had no event time yet."""
    return [
        (
            StateHandle(old_index=i, old_parallelism=parallelism, path=f"blob-{i}"),
            {"window": {}} if w is None else {"window": {}, EVENT_TIME_KEY: ValveState(w)},
        )
        for i, w in enumerate(watermarks)
    ]


def resumed_at(snapshots, index, parallelism):
    state = restored_event_time(SimpleNamespace(index=index, parallelism=parallelism), snapshots)
    return MIN_WATERMARK if state is None else state.watermark


def test_a_subtask_that_had_no_event_time_resumes_at_the_minimum():
    snapshots = handles(2, [None, 5000])
    assert resumed_at(snapshots, 0, 2) == MIN_WATERMARK
    assert resumed_at(snapshots, 1, 2) == 5000
    # rescaled: the lowest any old subtask stood at, one without event time included
    assert resumed_at(snapshots, 0, 3) == MIN_WATERMARK
    assert resumed_at(handles(2, [7000, 5000]), 2, 3) == 5000
    assert (
        restored_event_time(SimpleNamespace(index=0, parallelism=2), handles(2, [None, None]))
        is None
    )
