"""FileSource on a real Ray: files split over subtasks, and read positions restored after
kills, so each input row reaches the committed output exactly once."""

from __future__ import annotations

import json

from rayflow import FileSource, StreamExecutionEnvironment
from rayflow.config import RestartStrategies
from rayflow.testing import Fault, FaultPlan, FaultPoint, inject_faults
from sinks.basic import CollectSink


def write_files(root, files: int, rows: int) -> list[int]:
    ids = []
    for f in range(files):
        lines = []
        for r in range(rows):
            ids.append(f * rows + r)
            lines.append(json.dumps({"id": f * rows + r}))
        (root / f"input-{f:02d}.jsonl").write_text("\n".join(lines) + "\n")
    return ids


def test_files_are_split_over_subtasks_and_each_row_is_read_once(tmp_path):
    ids = write_files(tmp_path, files=5, rows=2000)
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    sink = CollectSink()
    env.from_source(FileSource(str(tmp_path), "jsonl", batch_size=500), "files").sink_to(sink)
    table = env.execute("file-source").sink_result(sink)
    assert sorted(table.column("id").to_pylist()) == ids


def test_read_positions_survive_kills_with_exactly_once_output(tmp_path):
    data = tmp_path / "in"
    data.mkdir()
    ids = write_files(data, files=4, rows=25_000)
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(100)
    env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "chk"))
    env.set_restart_strategy(RestartStrategies.fixed_delay_restart(5, 0))
    inject_faults(
        env,
        FaultPlan(
            [
                Fault(FaultPoint.AFTER_RECORDS, attempt=0, subtask=1, records=20_000),
                Fault(FaultPoint.AFTER_SNAPSHOT, attempt=1, subtask=0, checkpoint=2),
            ]
        ),
    )
    sink = CollectSink()
    source = FileSource(str(data), "jsonl", batch_size=1000)
    source.records_per_second = 50_000
    env.from_source(source, "files").map_batches(lambda b: b, name="relay").sink_to(sink)
    result = env.execute("file-source-chaos")
    assert result.restarts == 2
    assert sorted(sink_ids := result.sink_result(sink).column("id").to_pylist()) == ids
    assert len(sink_ids) == len(set(sink_ids))
