"""A FileSource that monitors a directory (local) or a prefix (S3, moto's server) on a real
Ray: files that appear while the job runs are read, the job is stopped with a savepoint
(to the same store), more files appear, the job resumes from the savepoint: every record
of every file reaches the exactly-once file sink once."""

from __future__ import annotations

import io
import os
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import tests.s3_server as _s3_fixtures
from rayflow import FileSource, StreamExecutionEnvironment
from rayflow.status import JobState
from sinks.files import FileSink

s3_server = _s3_fixtures.s3_server
s3_bucket = _s3_fixtures.s3_bucket

ROWS = 200


def parquet_bytes(first: int) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table({"value": pa.array(range(first, first + ROWS), pa.int64())}), out)
    return out.getvalue()


class Store:
    """Where input files appear and checkpoints and savepoints go: a local directory or
    an S3 bucket."""

    def __init__(self, kind: str, tmp_path, server=None, bucket=None) -> None:
        self.kind = kind
        if kind == "local":
            self.inputs = str(tmp_path / "in")
            os.makedirs(self.inputs)
            self.root = str(tmp_path)
            self.options: dict = {}
            self.filesystem = None
        else:
            self.server, self.bucket = server, bucket
            self.inputs = f"{bucket}/in"
            self.root = f"s3://{bucket}"
            self.options = server.storage_options()
            self.filesystem = pafs.S3FileSystem(**self.options)

    def add(self, index: int) -> None:
        data = parquet_bytes(index * ROWS)
        name = f"part-{index:04d}.parquet"
        if self.kind == "local":
            temp = os.path.join(self.inputs, f".{name}")
            with open(temp, "wb") as out:
                out.write(data)
            os.replace(temp, os.path.join(self.inputs, name))
        else:
            self.server.client().put_object(Bucket=self.bucket, Key=f"in/{name}", Body=data)

    def source(self) -> FileSource:
        return FileSource(
            self.inputs, "parquet", filesystem=self.filesystem, batch_size=50
        ).monitor_continuously(0.1)


def build(store: Store, out: str) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    env.enable_checkpointing(200)
    env.get_checkpoint_config().set_checkpoint_storage(f"{store.root}/chk", **store.options)
    (
        env.from_source(store.source(), "files")
        .uid("files")
        .sink_to(FileSink(out, "parquet"), name="out")
        .uid("out")
    )
    return env


def committed(out: str) -> list[int]:
    names = (
        sorted(n for n in os.listdir(out) if not n.startswith(".")) if os.path.isdir(out) else []
    )
    return [
        v for n in names for v in pq.read_table(os.path.join(out, n)).column("value").to_pylist()
    ]


def wait_for(out: str, count: int, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if len(committed(out)) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"{len(committed(out))} of {count} records after {timeout_s} s")


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_monitored_files_are_read_once_across_a_stop_with_savepoint(kind, tmp_path, request):
    if kind == "s3":
        store = Store(
            kind,
            tmp_path,
            request.getfixturevalue("s3_server"),
            request.getfixturevalue("s3_bucket"),
        )
    else:
        store = Store(kind, tmp_path)
    out = str(tmp_path / "out")
    job = f"monitor-{kind}-{time.time_ns()}"
    store.add(0)
    client = build(store, out).execute_async(job)
    wait_for(out, ROWS)
    for index in (1, 2, 3):  # appear while the job runs
        store.add(index)
    wait_for(out, 4 * ROWS)
    savepoint = client.stop_with_savepoint(f"{store.root}/savepoints")
    assert client.get_job_status() is JobState.FINISHED
    assert savepoint.startswith(store.root)
    assert sorted(committed(out)) == list(range(4 * ROWS))

    for index in (4, 5):  # appear while the job is stopped
        store.add(index)
    client = build(store, out).execute_async(job, restore_from=savepoint)
    wait_for(out, 6 * ROWS)
    store.add(6)  # and after it resumed
    wait_for(out, 7 * ROWS)
    client.stop_with_savepoint(f"{store.root}/savepoints")
    assert sorted(committed(out)) == list(range(7 * ROWS))
