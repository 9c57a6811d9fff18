"""FileSink on a real Ray, writing real files: every record exactly once in visible part
files (JSON lines, CSV, Parquet), nothing in progress left, rolling on size, and the
build-time refusal of EXACTLY_ONCE without checkpoints."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq
import pytest

from rayflow import DeliveryGuarantee, NumberSequenceSource, StreamExecutionEnvironment
from rayflow.sink import RollingPolicy
from sinks.files import FileSink

N = 60_000
P = 2


def enrich(batch: pa.RecordBatch) -> pa.RecordBatch:
    values = batch.column("value")
    return pa.record_batch(
        {
            "value": values,
            "square": pc.multiply(values, values),
            "label": pc.binary_join_element_wise("n", pc.cast(values, pa.string()), ""),
        }
    )


def build(
    sink: FileSink,
    tmp_path,
    n: int = N,
    batch_size: int = 1000,
    rate: float | None = 40_000,
    checkpoint_ms: int | None = 200,
):
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(P)
    if checkpoint_ms is not None:
        env.enable_checkpointing(checkpoint_ms)
        env.get_checkpoint_config().set_checkpoint_storage(str(tmp_path / "chk"))
    (
        env.from_source(
            NumberSequenceSource(0, n - 1, batch_size=batch_size, records_per_second=rate),
            "numbers",
        )
        .map_batches(enrich, name="enrich")
        .sink_to(sink, name="files")
        .uid("files")
    )
    return env


def read_part(path: str, fmt: str) -> pa.Table:
    if fmt == "jsonl":
        return pjson.read_json(path)
    if fmt == "csv":
        return pcsv.read_csv(path)
    return pq.read_table(path)


def read_committed(directory, fmt: str) -> tuple[list[str], pa.Table]:
    names = sorted(n for n in os.listdir(directory) if not n.startswith("."))
    tables = [read_part(os.path.join(directory, n), fmt) for n in names]
    return names, pa.concat_tables(tables) if tables else pa.table({})


def in_progress(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(".")]


def unique_job(name: str) -> str:
    return f"{name}-{time.time_ns()}"


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_exactly_once_every_record_once_in_visible_parts(tmp_path, fmt):
    out = tmp_path / "out"
    sink = FileSink(str(out), fmt, DeliveryGuarantee.EXACTLY_ONCE)
    env = build(sink, tmp_path)
    job = unique_job(f"files-{fmt}")
    result = env.execute(job)

    names, table = read_committed(out, fmt)
    assert in_progress(out) == []
    values = table.column("value").to_pylist()
    assert sorted(values) == list(range(N))  # every record, once
    assert table.column("square").to_pylist() == [v * v for v in values]
    assert table.column("label").to_pylist() == [f"n{v}" for v in values]
    # Each subtask committed parts (one per checkpoint that saw its records; how many is
    # a matter of timing), and the result lists them in name order (subtask, sequence).
    assert len(result.completed_checkpoints) >= 2
    for subtask in range(P):
        assert any(f"_{subtask:04d}-" in n for n in names)
    print(f"{fmt}: {len(names)} parts over {len(result.completed_checkpoints)} checkpoints")
    assert [os.path.basename(p) for p in result.sink_result(sink)] == names
    assert all(n.startswith("part-") and n.endswith(f".{fmt}") for n in names)
    # Within a subtask, files in name order hold its records in order.
    for subtask in range(P):
        mine = [n for n in names if f"_{subtask:04d}-" in n]
        seq = pa.concat_tables(read_part(os.path.join(out, n), fmt) for n in mine)
        got = seq.column("value").to_pylist()
        assert got == sorted(got)


def test_parts_roll_on_size(tmp_path):
    out = tmp_path / "out"
    limit = 16 * 1024
    sink = FileSink(
        out, "jsonl", DeliveryGuarantee.EXACTLY_ONCE, RollingPolicy(max_part_size=limit)
    )
    env = build(sink, tmp_path, n=20_000, batch_size=100, rate=None, checkpoint_ms=1000)
    result = env.execute(unique_job("files-rolling"))
    names, table = read_committed(out, "jsonl")
    assert in_progress(out) == []
    assert sorted(table.column("value").to_pylist()) == list(range(20_000))
    sizes = [os.path.getsize(out / n) for n in names]
    batch_bytes = 8192  # a batch of 100 records is ~5 KiB of JSON
    # A part rolls at the first batch that takes it to >= limit bytes...
    assert max(sizes) < limit + batch_bytes
    assert len(names) >= sum(sizes) // (limit + batch_bytes)
    # ...and otherwise only at a checkpoint barrier or at the end of input.
    checkpoints = len(result.completed_checkpoints)
    assert sum(size < limit for size in sizes) <= P * checkpoints
    print(
        f"size rolling: {len(names)} parts, {checkpoints} checkpoints, "
        f"sizes {min(sizes)}..{max(sizes)} bytes"
    )


def test_none_without_checkpoints_makes_everything_visible(tmp_path):
    out = tmp_path / "out"
    sink = FileSink(out, "parquet", DeliveryGuarantee.NONE, RollingPolicy(max_part_size=64_000))
    env = build(sink, tmp_path, rate=None, checkpoint_ms=None)
    env.execute(unique_job("files-none"))
    names, table = read_committed(out, "parquet")
    assert in_progress(out) == []
    assert len(names) > P
    assert sorted(table.column("value").to_pylist()) == list(range(N))


def test_at_least_once_without_failures_writes_each_record_once(tmp_path):
    out = tmp_path / "out"
    sink = FileSink(out, "csv", DeliveryGuarantee.AT_LEAST_ONCE)
    env = build(sink, tmp_path)
    env.execute(unique_job("files-alo"))
    _, table = read_committed(out, "csv")
    assert in_progress(out) == []
    assert sorted(table.column("value").to_pylist()) == list(range(N))


def test_unspecified_guarantee_follows_the_checkpointing(tmp_path):
    sink = FileSink(tmp_path / "out", "jsonl")
    graph = build(sink, tmp_path).get_job_graph()
    assert graph.sink_guarantees()["files"].delivery_guarantee is DeliveryGuarantee.EXACTLY_ONCE
    off = FileSink(tmp_path / "out", "jsonl")
    graph = build(off, tmp_path, checkpoint_ms=None).get_job_graph()
    assert graph.sink_guarantees()["files"].delivery_guarantee is DeliveryGuarantee.NONE
    # The resolution is the job graph's; the sink objects are left as they were.
    assert not off.guarantee_requested and off.delivery_guarantee is sink.delivery_guarantee


def test_exactly_once_with_checkpointing_off_fails_at_build_time(tmp_path):
    sink = FileSink(tmp_path / "out", "jsonl", DeliveryGuarantee.EXACTLY_ONCE)
    env = build(sink, tmp_path, checkpoint_ms=None)
    with pytest.raises((ValueError,), match="checkpoint"):
        env.get_job_graph()
    with pytest.raises((ValueError,), match="checkpoint"):
        env.execute(unique_job("files-eo-off"))
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
