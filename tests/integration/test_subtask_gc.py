"""A subtask's actor process runs with the collector settings of rayflow.runtime.gc_tuning;
the driver's process keeps its own."""

from __future__ import annotations

import gc
import os

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.runtime.gc_tuning import SUBTASK_GC_THRESHOLD0
from sinks.basic import CollectSink


def test_subtask_processes_collect_less_often_and_the_driver_is_left_alone():
    driver = gc.get_threshold()
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    sink = CollectSink()
    (
        env.from_source(NumberSequenceSource(0, 99, batch_size=10), "numbers")
        .map(
            lambda r: {
                "pid": os.getpid(),
                "threshold0": gc.get_threshold()[0],
                "frozen": gc.get_freeze_count(),
            }
        )
        .sink_to(sink)
    )
    table = env.execute("subtask-gc").sink_result(sink)
    assert table.num_rows == 100
    pids = set(table.column("pid").to_pylist())
    assert os.getpid() not in pids and len(pids) == 2
    assert set(table.column("threshold0").to_pylist()) == {SUBTASK_GC_THRESHOLD0}
    # what the process held at start is out of every full collection's way
    assert min(table.column("frozen").to_pylist()) > 10_000
    assert gc.get_threshold() == driver
    assert gc.get_freeze_count() == 0  # the driver's objects are left alone
