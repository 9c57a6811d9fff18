"""Unbounded sources without Ray: DataGeneratorSource positions and rescaling, and
FileSource.monitor_continuously reading each file once across snapshots and restores
(real files), a file read in part resuming at its row."""

from __future__ import annotations

import datetime as dt
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayflow.datagen import DataGeneratorSource
from rayflow.file_monitor import WatchSplit, owner_of
from rayflow.sources import FileSource


def drain(reader, max_batches: int = 10_000, stop_when_idle: bool = True) -> list[int]:
    out: list[int] = []
    for _ in range(max_batches):
        batch = reader.read_batch()
        if batch is None or (stop_when_idle and batch.num_rows == 0):
            break
        out.extend(batch.column("value").to_pylist())
    return out


def deal(splits, parallelism):
    per = [[] for _ in range(parallelism)]
    for i, split in enumerate(sorted(splits, key=lambda s: s.split_id)):
        per[i % parallelism].append(split)
    return per


# --- DataGeneratorSource ------------------------------------------------------------------


def test_bounded_generator_makes_each_index_once_across_a_rescale():
    source = DataGeneratorSource(count=1000, batch_size=37)
    readers = [source.create_reader(s) for s in deal(source.create_splits(3), 3)]
    seen = [v for r in readers for v in drain(r, max_batches=5)]
    saved = [s for r in readers for s in r.snapshot_splits()]
    readers = [source.create_reader(s) for s in deal(saved, 2)]  # restored at p=2
    seen += [v for r in readers for v in drain(r)]
    assert sorted(seen) == list(range(1000))


def test_unbounded_generator_never_ends_and_uses_the_generator():
    source = DataGeneratorSource(lambda i: {"value": i, "double": i * 2}, records_per_second=1000.0)
    assert not source.bounded and source.batch_size == 10  # 10 ms worth at 1000/s
    reader = source.create_reader(source.create_splits(1))
    for _ in range(50):
        batch = reader.read_batch()
        assert batch is not None and batch.num_rows == 10
    assert batch.column("double").to_pylist() == [2 * v for v in batch.column("value").to_pylist()]


def test_generator_making_the_wrong_number_of_records_is_a_clear_error():
    source = DataGeneratorSource(lambda i: {"value": i[:1]}, count=10, batch_size=5)
    with pytest.raises(ValueError, match="made 1 records for 5 indices"):
        source.create_reader(source.create_splits(1)).read_batch()


# --- FileSource.monitor_continuously -------------------------------------------------------


def write(directory, name: str, values) -> None:
    table = pa.table({"value": pa.array(list(values), pa.int64())})
    pq.write_table(table, os.path.join(directory, f".{name}.tmp"))
    os.replace(os.path.join(directory, f".{name}.tmp"), os.path.join(directory, name))


def test_monitoring_reads_new_files_once_and_resumes_a_file_in_part(tmp_path):
    directory = tmp_path / "in"
    directory.mkdir()
    write(directory, "a.parquet", range(0, 100))
    source = FileSource(str(directory), "parquet", batch_size=30).monitor_continuously(0.01)
    assert source.monitor_interval_s == 0.01
    splits = source.create_splits(2)
    assert [type(s) for s in splits] == [WatchSplit, WatchSplit]
    reader = source.create_reader(splits)
    first = reader.read_batch()
    assert first.num_rows == 0  # a file is read once two listings saw it alike
    for _ in range(1000):
        first = reader.read_batch()
        if first.num_rows:
            break
        time.sleep(0.001)
    assert first.column("value").to_pylist() == list(range(30))
    saved = reader.snapshot_splits()  # 30 rows of a.parquet read
    assert sum(s.rows_read for s in saved) == 30
    drain(reader)  # read on past the snapshot: lost with the "failure" below

    # restored from the snapshot at another parallelism: the rest of a, then new files
    restored = [source.create_reader(s) for s in deal(saved, 1)]
    write(directory, "b.parquet", range(100, 150))
    write(directory, "c.parquet", range(150, 170))
    got = list(range(30))
    deadline = time.time() + 10
    while len(got) < 170 and time.time() < deadline:
        for reader in restored:
            batch = reader.read_batch()
            assert batch is not None  # never ends
            got.extend(batch.column("value").to_pylist() if batch.num_rows else [])
    assert sorted(got) == list(range(170))
    saved = [s for r in restored for s in r.snapshot_splits()]
    assert sorted(p for s in saved for p in s.done) == sorted(
        str(directory / n) for n in ("a.parquet", "b.parquet", "c.parquet")
    )
    # a restore after everything was read reads nothing again
    again = [source.create_reader(s) for s in deal(saved, 2)]
    time.sleep(0.02)
    assert [v for r in again for v in drain(r)] == []


def test_a_file_still_being_written_in_place_is_read_once_it_settled(tmp_path):
    """A CSV file written in place, listed while its writer is half way: read whole once
    two listings saw the same size and time, never in part."""
    directory = tmp_path / "in"
    directory.mkdir()
    source = FileSource(str(directory), "csv").monitor_continuously(1e-6)
    reader = source.create_reader(source.create_splits(1))
    got: list[int] = []
    with open(directory / "a.csv", "w") as out:
        out.write("value\n" + "".join(f"{i}\n" for i in range(50)))
        out.flush()
        got.extend(drain(reader))  # listed half written
        out.write("".join(f"{i}\n" for i in range(50, 100)))
    for _ in range(1000):
        got.extend(drain(reader))
        if len(got) >= 100:
            break
        time.sleep(0.001)
    assert sorted(got) == list(range(100)), "a file was read in part"


def test_files_belong_to_one_watch_split_and_hidden_files_are_skipped(tmp_path):
    directory = tmp_path / "in"
    (directory / "_temporary").mkdir(parents=True)
    write(directory, "x.parquet", [1])
    write(directory / "_temporary", "y.parquet", [2])
    source = FileSource(str(directory), "parquet").monitor_continuously(dt.timedelta(seconds=1))
    assert source.list_paths() == [str(directory / "x.parquet")]
    owners = {owner_of(f"{directory}/f{i}", 3) for i in range(30)}
    assert owners == {0, 1, 2}
    with pytest.raises(ValueError, match="interval must be > 0"):
        FileSource(str(directory), "parquet").monitor_continuously(0)


def test_a_missing_directory_is_watched_until_it_appears(tmp_path):
    directory = tmp_path / "later"
    source = FileSource(str(directory), "parquet").monitor_continuously(0.01)
    reader = source.create_reader(source.create_splits(1))
    assert reader.read_batch().num_rows == 0
    directory.mkdir()
    write(directory, "a.parquet", np.arange(5))
    got: list[int] = []
    for _ in range(100):  # read once two listings saw it alike
        time.sleep(0.02)
        got.extend(drain(reader))
        if got:
            break
    assert got == [0, 1, 2, 3, 4]
