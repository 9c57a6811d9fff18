"""Sources know their position: splits, readers, and resuming from a snapshot."""

import json

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from rayflow import CollectionSource, FileSource, NumberSequenceSource


def drain(reader):
    rows = []
    while (batch := reader.read_batch()) is not None:
        rows.extend(batch.to_pylist())
    return rows


def test_number_sequence_is_inclusive_and_split_evenly():
    source = NumberSequenceSource(1, 10, batch_size=3)
    splits = source.create_splits(3)
    values = [r["value"] for s in splits for r in drain(source.create_reader([s]))]
    assert values == list(range(1, 11))


def test_reader_resumes_from_a_snapshot_of_its_splits():
    source = NumberSequenceSource(0, 99, batch_size=7)
    reader = source.create_reader(source.create_splits(2))
    first = [r["value"] for r in reader.read_batch().to_pylist()]
    snapshot = reader.snapshot_splits()
    reader.read_batch()  # progress after the snapshot is replayed by a restored reader
    resumed = source.create_reader(snapshot)
    rest = [r["value"] for r in drain(resumed)]
    assert sorted(first + rest) == list(range(100))


def test_collection_source_from_dicts_and_tables():
    records = [{"a": i, "b": str(i)} for i in range(25)]
    source = CollectionSource(records, batch_size=4)
    got = [r for s in source.create_splits(3) for r in drain(source.create_reader([s]))]
    assert got == records
    table_source = CollectionSource(pa.Table.from_pylist(records), batch_size=10)
    assert drain(table_source.create_reader(table_source.create_splits(1))) == records
    with pytest.raises(ValueError, match="empty collection needs a schema"):
        CollectionSource([])


@pytest.fixture
def data_dir(tmp_path):
    rows = [{"id": i, "name": f"n{i}"} for i in range(30)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:10]) + "\n")
    pcsv.write_csv(pa.Table.from_pylist(rows[10:20]), str(tmp_path / "b.csv"))
    pq.write_table(pa.Table.from_pylist(rows[20:]), str(tmp_path / "c.parquet"))
    (tmp_path / ".hidden.jsonl").write_text('{"id": -1, "name": "hidden"}\n')
    return tmp_path, rows


@pytest.mark.parametrize(
    ("fmt", "name", "part"),
    [
        ("jsonl", "a.jsonl", slice(0, 10)),
        ("csv", "b.csv", slice(10, 20)),
        ("parquet", "c.parquet", slice(20, 30)),
    ],
)
def test_file_source_reads_each_format(data_dir, fmt, name, part):
    root, rows = data_dir
    source = FileSource(str(root / name), fmt, batch_size=3)
    assert drain(source.create_reader(source.create_splits(2))) == rows[part]


def test_file_source_splits_a_directory_by_file_and_skips_hidden_files(tmp_path):
    for i in range(3):
        (tmp_path / f"part-{i}.jsonl").write_text(
            "\n".join(json.dumps({"id": i * 10 + j}) for j in range(10)) + "\n"
        )
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".part-9.jsonl.inprogress").write_text('{"id": -1}\n')
    source = FileSource(str(tmp_path), "jsonl", batch_size=4)
    splits = source.create_splits(2)
    assert len(splits) == 3
    reader = source.create_reader(splits)
    first = reader.read_batch().to_pylist()
    resumed = source.create_reader(reader.snapshot_splits())
    ids = sorted(r["id"] for r in first + drain(resumed))
    assert ids == list(range(30))


def test_file_source_errors_name_the_option_and_the_file(tmp_path):
    with pytest.raises(ValueError, match="format must be one of"):
        FileSource(str(tmp_path), "xml")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        FileSource(str(tmp_path / "missing"), "jsonl").create_splits(1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    source = FileSource(str(bad), "jsonl")
    with pytest.raises(ValueError, match="bad.jsonl"):
        drain(source.create_reader(source.create_splits(1)))
