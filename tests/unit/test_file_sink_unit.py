"""FileSink without Ray: names, the transaction steps, idempotent commit, abort, lingering
in-progress files, and the sink operator's visibility rules per delivery guarantee."""

from __future__ import annotations

import collections
import json
import logging
import os
import pickle

import cloudpickle
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import sinks.files
from rayflow.guarantees import DeliveryGuarantee
from rayflow.runtime.operators import OperatorContext
from rayflow.runtime.sink_operator import TwoPhaseCommitSinkOperator
from rayflow.sink import RollingPolicy, SinkContext, UnsupportedGuaranteeError
from sinks.files import FileCommittable, FileSink

EO = DeliveryGuarantee.EXACTLY_ONCE


def ctx(subtask: int = 0, job: str = "job", uid: str = "files", attempt: int = 0) -> SinkContext:
    return SinkContext(job, uid, subtask, 2, attempt)


def batch(values) -> pa.RecordBatch:
    return pa.record_batch({"value": pa.array(values, pa.int64())})


def visible(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if not n.startswith("."))


def hidden(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def write_part(sink: FileSink, values, subtask: int = 0, sequence: int = 0, **kw):
    txn = sink.begin_transaction(ctx(subtask, **kw), sequence)
    sink.write(txn, batch(values))
    return sink.pre_commit(txn)


# --- names and options -----------------------------------------------------------------


def test_names_are_hidden_until_commit_and_list_in_subtask_then_sequence_order(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    committables = [
        write_part(sink, [s * 100 + q], subtask=s, sequence=q)
        for s in (10, 2, 0)
        for q in (11, 3, 0)
    ]
    assert visible(tmp_path) == []
    assert all(
        n.startswith(".part-job_files_0") and ".jsonl.a0-" in n and n.endswith(".inprogress")
        for n in hidden(tmp_path)
    )
    for c in committables:
        sink.commit(c)
    names = visible(tmp_path)
    assert hidden(tmp_path) == []
    assert names[0] == "part-job_files_0000-00000000.jsonl"
    assert names[-1] == "part-job_files_0010-00000011.jsonl"
    # Name order is subtask order, then sequence order.
    values = [json.loads((tmp_path / n).read_text())["value"] for n in names]
    assert values == sorted(values)


def test_a_late_writer_of_a_failed_attempt_never_shares_a_file_with_its_successor(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    zombie = sink.begin_transaction(ctx(attempt=0), 4)
    successor = sink.begin_transaction(ctx(attempt=1), 4)
    sink.write(successor, batch([1]))
    sink.write(zombie, batch([666]))  # still running after its attempt was declared failed
    assert zombie.tmp_path != successor.tmp_path
    assert zombie.final_path == successor.final_path  # final names stay deterministic
    c = sink.pre_commit(successor)
    sink.commit(c)
    assert read_values(tmp_path) == [1]
    assert sink.abort_lingering(ctx(attempt=1), []) == 1  # the zombie's part
    assert hidden(tmp_path) == []


def test_two_jobs_in_one_directory_do_not_collide(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    a = write_part(sink, [1], job="job a")
    b = write_part(sink, [2], job="job b")
    assert a.final_path != b.final_path
    assert sink.abort_lingering(ctx(0, job="job a"), []) == 1
    assert hidden(tmp_path) == [os.path.basename(b.tmp_path)]


def test_prefixes_never_merge_distinct_names(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    long = "nightly-aggregation-pipeline-for-customer-accounts-"
    prefixes = [
        sink.transaction_prefix(ctx(job=job, uid=uid))
        for job, uid in [
            ("job a", "u"),
            ("job-a", "u"),
            (long + "1", "u"),
            (long + "2", "u"),
            ("job", "a.b"),
            ("job", "a-b"),
            ("a", "b-c"),  # the contract's "a-b-c-" for both of these
            ("a-b", "c"),
        ]
    ]
    assert len(set(prefixes)) == len(prefixes)
    assert prefixes[1] == "part-job-a_u_0000-"  # a clean name stays as it is
    assert prefixes[5] == "part-job_a-b_0000-"
    assert all(len(p) < 80 for p in prefixes)


def test_result_lists_this_jobs_committed_parts_only(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    sink.setup("eo")
    mine = [write_part(sink, [q], subtask=s, sequence=q, job="eo") for s in (1, 0) for q in (1, 0)]
    for c in [*mine, write_part(sink, [9], job="eo-1"), write_part(sink, [9], job="eo", uid="x")]:
        sink.commit(c)
    write_part(sink, [9], sequence=7, job="eo")  # pre-committed, not visible
    listed = sink.merge_results([4])
    assert listed == sorted(c.final_path for c in mine) + [
        str(tmp_path / "part-eo_x_0000-00000000.jsonl")
    ]
    assert listed == sink.committed_files("part-eo_")


def test_uid_ending_in_digits_is_not_another_subtask(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    other = write_part(sink, [1], subtask=1, uid="x-0000")
    assert sink.abort_lingering(ctx(0, uid="x"), []) == 0
    assert hidden(tmp_path) == [os.path.basename(other.tmp_path)]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_each_format_reads_back(tmp_path, fmt):
    sink = FileSink(str(tmp_path), fmt, EO)
    txn = sink.begin_transaction(ctx(), 0)
    assert sink.is_empty(txn) and sink.transaction_size(txn) == 0
    sink.write(txn, batch([1, 2, 3]))
    size1 = sink.transaction_size(txn)
    sink.write(txn, batch([4, 5]))
    assert not sink.is_empty(txn)
    assert sink.transaction_size(txn) > size1 > 0
    c = sink.pre_commit(txn)
    assert isinstance(c, FileCommittable)
    assert c.size == os.path.getsize(c.tmp_path)
    sink.commit(c)
    assert c.final_path.endswith(f".{fmt}")
    if fmt == "jsonl":
        with open(c.final_path) as f:
            values = [json.loads(line)["value"] for line in f]
    elif fmt == "csv":
        values = pcsv.read_csv(c.final_path).column("value").to_pylist()
    else:
        values = pq.read_table(c.final_path).column("value").to_pylist()
    assert values == [1, 2, 3, 4, 5]


def test_empty_transaction_creates_no_file(tmp_path):
    sink = FileSink(tmp_path, "parquet", EO)
    txn = sink.begin_transaction(ctx(), 0)
    sink.write(txn, batch([]))
    assert sink.is_empty(txn)
    sink.abort_transaction(txn)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"format": "xml"}, "format must be one of"),
        ({"path": ""}, "path"),
        ({"path": "nosuchscheme://bucket/x"}, "path"),
    ],
)
def test_bad_options_name_the_option(tmp_path, kwargs, match):
    args = {"path": str(tmp_path), "format": "jsonl", **kwargs}
    with pytest.raises(ValueError, match=match):
        FileSink(args.pop("path"), **args)


def test_path_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("x")
    with pytest.raises(ValueError, match="path .* is a file"):
        FileSink(target)


def test_filesystem_must_be_a_pyarrow_filesystem(tmp_path):
    with pytest.raises(TypeError, match="filesystem"):
        FileSink(tmp_path, filesystem="local")


def test_guarantees_are_checked_by_the_contract(tmp_path):
    with pytest.raises(TypeError, match="delivery_guarantee"):
        FileSink(tmp_path, delivery_guarantee="exactly-once")
    sink = FileSink(tmp_path)
    assert sink.delivery_guarantee is EO and not sink.guarantee_requested
    assert issubclass(UnsupportedGuaranteeError, ValueError)


def test_uri_and_subtree_filesystem(tmp_path):
    by_uri = FileSink(f"file://{tmp_path}/out", "jsonl", EO)
    by_uri.commit(write_part(by_uri, [1]))
    subtree = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    in_subtree = FileSink("sub", "jsonl", EO, filesystem=subtree)
    c = write_part(in_subtree, [2])
    in_subtree.commit(c)  # the local fsync path resolves through the subtree
    assert (
        visible(tmp_path / "out")
        == visible(tmp_path / "sub")
        == ["part-job_files_0000-00000000.jsonl"]
    )


def test_sink_pickles_without_open_files(tmp_path):
    sink = FileSink(tmp_path, "csv", EO)
    txn = sink.begin_transaction(ctx(), 0)
    sink.write(txn, batch([1]))
    data = cloudpickle.dumps(sink)
    copy = pickle.loads(data)
    # The sink is a builder: the open part stays with this process's writer, never pickled.
    assert copy.directory == sink.directory
    assert ".inprogress" not in repr(vars(sink)) and b".inprogress" not in data
    with pytest.raises(ValueError, match="not an open transaction"):
        copy.write(txn, batch([2]))
    sink.abort_transaction(txn)


# --- commit ----------------------------------------------------------------------------


def test_commit_is_idempotent(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    c = write_part(sink, [1, 2, 3])
    sink.commit(c)
    sink.commit(c)  # tmp gone, final present with the right size: already committed
    assert visible(tmp_path) == [os.path.basename(c.final_path)]
    assert hidden(tmp_path) == []
    # A commit repeated by another process (a restored subtask) is success too.
    pickle.loads(pickle.dumps(sink)).commit(pickle.loads(pickle.dumps(c)))


def test_commit_after_the_rename_already_happened_elsewhere(tmp_path):
    sink = FileSink(tmp_path, "parquet", EO)
    c = write_part(sink, [7, 8])
    os.rename(c.tmp_path, c.final_path)  # e.g. a commit that ran before a crash
    sink.commit(c)
    assert pq.read_table(c.final_path).column("value").to_pylist() == [7, 8]


def test_commit_of_lost_data_is_loud(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    c = write_part(sink, [1])
    os.remove(c.tmp_path)
    with pytest.raises(RuntimeError, match="lost"):
        sink.commit(c)


def test_commit_refuses_a_final_file_of_another_size(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    c = write_part(sink, [1])
    os.remove(c.tmp_path)
    (tmp_path / os.path.basename(c.final_path)).write_text("something else entirely\n")
    with pytest.raises(RuntimeError, match="bytes"):
        sink.commit(c)


class LocalButNotLocal(pafs.FileSystemHandler):
    """A local directory behind ``pyarrow.fs.PyFileSystem``: the sink cannot tell it is
    local (as with s3://, gs://, HDFS), so it has no inodes to go by."""

    def __init__(self) -> None:
        self.fs = pafs.LocalFileSystem()

    def __eq__(self, other):
        return isinstance(other, LocalButNotLocal)

    def __ne__(self, other):
        return not self == other

    def get_type_name(self):
        return "not-local"

    def normalize_path(self, path):
        return path

    def equals(self, other):
        return self == other

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise NotImplementedError

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.fs.open_input_stream(path, compression=None)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return self.fs.open_output_stream(path, compression=None)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, compression=None)


FILESYSTEMS = ["local", "subtree-local", "subtree-not-local"]


def sink_on(kind: str, root, fmt: str = "jsonl") -> FileSink:
    """A sink writing into ``root/out`` through a filesystem of the given kind."""
    if kind == "local":
        return FileSink(root / "out", fmt, EO)
    base = (
        pafs.LocalFileSystem() if kind == "subtree-local" else pafs.PyFileSystem(LocalButNotLocal())
    )
    return FileSink("out", fmt, EO, filesystem=pafs.SubTreeFileSystem(str(root), base))


def on_disk(root, c: FileCommittable) -> str:
    return str(root / "out" / os.path.basename(c.final_path))


@pytest.mark.parametrize("kind", FILESYSTEMS)
def test_repeated_commit_succeeds_on_every_filesystem(tmp_path, kind):
    sink = sink_on(kind, tmp_path)
    c = write_part(sink, [1, 2])
    assert c.token and (c.file_id is None) == (kind == "subtree-not-local")
    sink.commit(c)
    sink.commit(c)
    copy = pickle.loads(cloudpickle.dumps(sink))  # a restored subtask, in another process
    copy.commit(pickle.loads(pickle.dumps(c)))
    assert visible(tmp_path / "out") == [os.path.basename(c.final_path)]
    assert sink.committed_files() == [c.final_path] and sink.in_progress_files() == []
    if kind == "subtree-not-local":  # the marker is hidden from readers and listings
        assert hidden(tmp_path / "out") == [f".{os.path.basename(c.final_path)}.committed"]
    else:
        assert hidden(tmp_path / "out") == []


@pytest.mark.parametrize("kind", FILESYSTEMS)
def test_repeated_commit_refuses_a_same_size_file_of_another_transaction(tmp_path, kind):
    # The job run again under its name (or a replay) writes the same part name with a
    # part of the same size: the first transaction's repeated commit must not take that
    # file for its own and claim exactly-once.
    first = sink_on(kind, tmp_path)
    ours = write_part(first, [1])
    first.commit(ours)
    second = sink_on(kind, tmp_path)  # another run, same job name, same directory
    theirs = write_part(second, [2])
    assert theirs.final_path == ours.final_path and theirs.size == ours.size
    second.commit(theirs)  # replaces the final file
    with pytest.raises(RuntimeError, match="another transaction|another file") as info:
        first.commit(ours)
    assert "something else wrote that name" in str(info.value)
    second.commit(theirs)  # the genuine repeated commit still succeeds
    assert read_values(tmp_path / "out") == [2]


@pytest.mark.parametrize("kind", ["local", "subtree-local"])
def test_repeated_commit_refuses_a_same_size_file_written_by_something_else(tmp_path, kind):
    # On a local disk the inode tells; elsewhere only a FileSink transaction's own marker
    # does (a writer that bypasses the sink is not seen there, see the module docstring).
    sink = sink_on(kind, tmp_path)
    c = write_part(sink, [1])
    sink.commit(c)
    final = on_disk(tmp_path, c)
    with open(final, "rb") as f:
        data = f.read()
    # Another writer puts a file of the same size (here: the same bytes) in its place.
    with open(final + ".new", "wb") as f:
        f.write(data)
    os.replace(final + ".new", final)
    with pytest.raises(RuntimeError, match="is gone and"):
        sink.commit(c)


def test_commit_marker_that_is_missing_is_not_ours(tmp_path):
    sink = sink_on("subtree-not-local", tmp_path)
    c = write_part(sink, [1])
    sink.commit(c)
    os.remove(tmp_path / "out" / f".{os.path.basename(c.final_path)}.committed")
    with pytest.raises(RuntimeError, match="commit marker .* does not exist"):
        sink.commit(c)


def test_file_identity_and_device_numbers(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    c = write_part(sink, [1])
    st = os.stat(c.tmp_path)
    assert c.file_id == (st.st_dev, st.st_ino, st.st_mtime_ns)
    sink.commit(c)
    dev, ino, mtime_ns = c.file_id
    # Another machine (a directory shared over NFS) or another boot may show the file
    # under another device number: inode, mtime and size still identify it.
    sink.commit(c._replace(file_id=(dev + 1, ino, mtime_ns), boot_id="another-boot"))
    sink.commit(c._replace(file_id=(dev + 1, ino, mtime_ns), boot_id=None))
    if c.boot_id is not None:  # in the same boot a device number that differs counts
        with pytest.raises(RuntimeError, match="another file"):
            sink.commit(c._replace(file_id=(dev + 1, ino, mtime_ns)))
    with pytest.raises(RuntimeError, match="another file"):
        sink.commit(c._replace(file_id=(dev, ino + 1, mtime_ns), boot_id=None))
    with pytest.raises(RuntimeError, match="another file"):
        sink.commit(c._replace(file_id=(dev, ino, mtime_ns + 1)))


# FileCommittable as older versions defined it.
OldFileCommittable = collections.namedtuple(
    "FileCommittable", ["tmp_path", "final_path", "size"], module="sinks.files"
)


def old_pickle(c: FileCommittable, monkeypatch) -> bytes:
    """``c`` pickled as an older version pickled its 3-field FileCommittable."""
    old = OldFileCommittable(c.tmp_path, c.final_path, c.size)
    with monkeypatch.context() as patch:
        patch.setattr(sinks.files, "FileCommittable", OldFileCommittable)
        return pickle.dumps(old, protocol=pickle.HIGHEST_PROTOCOL)


def test_committables_of_older_versions_still_load_and_commit(tmp_path, caplog, monkeypatch):
    sink = FileSink(tmp_path, "jsonl", EO)
    c = write_part(sink, [1])
    data = old_pickle(c, monkeypatch)
    assert b"boot_id" not in data and b"file_id" not in data
    old = pickle.loads(data)
    assert type(old) is FileCommittable
    assert old == (c.tmp_path, c.final_path, c.size, None, None, None)
    sink.commit(old)  # the in-progress file is there: renamed as always
    with caplog.at_level(logging.WARNING, logger="rayflow.sinks.files"):
        sink.commit(old)  # repeated: recognised by size only, and said so
        sink.commit(tuple(old[:3]))  # a plain tuple too
    assert "older version" in caplog.text
    assert read_values(tmp_path) == [1]
    other = write_part(sink, [22])  # a different size is refused even then
    os.remove(other.tmp_path)
    with pytest.raises(RuntimeError, match="bytes"):
        sink.commit(FileCommittable(other.tmp_path, c.final_path, other.size))


# --- abort -----------------------------------------------------------------------------


def test_abort_deletes_the_in_progress_file_only(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    c = write_part(sink, [1])
    sink.abort(c)
    sink.abort(c)  # already gone is success
    assert os.listdir(tmp_path) == []
    committed = write_part(sink, [2], sequence=1)
    sink.commit(committed)
    sink.abort(committed)  # never touches a committed part
    assert visible(tmp_path) == [os.path.basename(committed.final_path)]


def test_abort_transaction_closes_and_deletes(tmp_path):
    sink = FileSink(tmp_path, "parquet", EO)
    txn = sink.begin_transaction(ctx(), 0)
    sink.write(txn, batch([1, 2]))
    assert len(hidden(tmp_path)) == 1
    sink.abort_transaction(txn)
    assert os.listdir(tmp_path) == []


def test_close_drops_open_transactions(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    txn = sink.begin_transaction(ctx(), 0)
    sink.write(txn, batch([1]))
    kept = write_part(sink, [2], sequence=1)
    sink.close()
    assert hidden(tmp_path) == [os.path.basename(kept.tmp_path)]


def test_abort_lingering_keeps_the_listed_ones(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO)
    mine = [write_part(sink, [q], subtask=1, sequence=q) for q in range(4)]
    other_subtask = write_part(sink, [9], subtask=11, sequence=0)
    other_uid = write_part(sink, [9], subtask=1, sequence=0, uid="other")
    committed = write_part(sink, [5], subtask=1, sequence=5)
    sink.commit(committed)
    open_txn = sink.begin_transaction(ctx(1), 6)
    sink.write(open_txn, batch([6]))

    keep = [mine[0], mine[2]]
    assert sink.abort_lingering(ctx(1), keep) == 3  # mine[1], mine[3], the open one
    left = set(hidden(tmp_path))
    assert left == {
        os.path.basename(c.tmp_path) for c in (mine[0], mine[2], other_subtask, other_uid)
    }
    assert visible(tmp_path) == [os.path.basename(committed.final_path)]
    assert sink.abort_lingering(ctx(1), keep) == 0
    assert sink.abort_lingering(ctx(1, uid="nothing-here"), []) == 0


def test_none_mode_sweeps_parts_left_open_by_an_earlier_attempt(tmp_path):
    # Without checkpoints the runtime never calls abort_lingering; a NONE sink cleans up
    # after a killed attempt itself, at its first transaction.
    none = DeliveryGuarantee.NONE
    first = FileSink(tmp_path, "jsonl", none)
    txn = first.begin_transaction(ctx(attempt=0), 0)
    first.write(txn, batch([1]))  # the process dies with this part open
    other = first.begin_transaction(ctx(subtask=1, attempt=0), 0)
    first.write(other, batch([2]))
    assert len(hidden(tmp_path)) == 2

    again = pickle.loads(cloudpickle.dumps(first))  # the restarted subtask's copy
    mine = again.begin_transaction(ctx(attempt=1), 5)
    again.write(mine, batch([3]))
    # Subtask 0's leftover is gone; subtask 1's is not this subtask's to judge.
    assert set(hidden(tmp_path)) == {
        os.path.basename(other.tmp_path),
        os.path.basename(mine.tmp_path),
    }
    second = again.begin_transaction(ctx(attempt=1), 6)  # no second sweep: mine stays
    again.write(second, batch([4]))
    assert len(hidden(tmp_path)) == 3
    again.commit(again.pre_commit(mine))
    assert read_values(tmp_path) == [3]


def test_abort_lingering_on_a_missing_directory(tmp_path):
    sink = FileSink(tmp_path / "not-yet", "jsonl", EO)
    assert sink.abort_lingering(ctx(), []) == 0


# --- driven by the sink operator -------------------------------------------------------


def operator(sink: FileSink, subtask: int = 0, attempt: int = 0) -> TwoPhaseCommitSinkOperator:
    op = TwoPhaseCommitSinkOperator(sink)
    op.open(OperatorContext("job", "files", "files", subtask, 2, 128, attempt, checkpointing=True))
    return op


def read_values(directory) -> list[int]:
    values = []
    for name in visible(directory):
        with open(os.path.join(directory, name)) as f:
            values.extend(json.loads(line)["value"] for line in f)
    return values


def test_none_mode_makes_parts_visible_when_they_roll(tmp_path):
    sink = FileSink(tmp_path, "jsonl", DeliveryGuarantee.NONE, RollingPolicy(max_part_size=1))
    op = operator(sink)
    op.process(batch([1, 2]))
    assert read_values(tmp_path) == [1, 2]  # visible at once, no checkpoint involved
    op.process(batch([3]))
    assert read_values(tmp_path) == [1, 2, 3]
    assert hidden(tmp_path) == []


def test_none_mode_without_size_rolling_commits_at_end_of_input(tmp_path):
    sink = FileSink(tmp_path, "csv", DeliveryGuarantee.NONE, RollingPolicy(max_part_size=None))
    op = operator(sink)
    op.process(batch([1, 2]))
    op.snapshot_state(1)  # checkpoints play no part in NONE mode
    assert visible(tmp_path) == []
    op.end_input()
    assert len(visible(tmp_path)) == 1 and hidden(tmp_path) == []


def test_at_least_once_commits_at_the_barrier(tmp_path):
    sink = FileSink(tmp_path, "jsonl", DeliveryGuarantee.AT_LEAST_ONCE)
    op = operator(sink)
    op.process(batch([1, 2]))
    assert visible(tmp_path) == []
    op.snapshot_state(1)
    assert read_values(tmp_path) == [1, 2]


def test_exactly_once_commits_when_the_checkpoint_completes_and_recovers(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO, RollingPolicy(max_part_size=None))
    op = operator(sink)
    op.recover(0)
    op.process(batch([1, 2]))
    state1 = op.snapshot_state(1)
    op.process(batch([3]))
    op.snapshot_state(2)  # checkpoint 2 never completes
    op.process(batch([4]))  # an open transaction
    assert visible(tmp_path) == [] and len(hidden(tmp_path)) == 3
    # The subtask dies here, before checkpoint 1's notification: nothing is visible.
    # A new attempt restores checkpoint 1, commits its part and aborts the rest.
    state1 = pickle.loads(pickle.dumps(state1))
    restored = operator(FileSink(tmp_path, "jsonl", EO), attempt=1)
    restored.restore_state([state1])
    restored.recover(1)
    assert read_values(tmp_path) == [1, 2]
    assert hidden(tmp_path) == []
    # The replay writes 3 and 4 again under new sequence numbers.
    restored.process(batch([3, 4]))
    restored.snapshot_state(2)
    restored.notify_checkpoint_complete(2)
    assert read_values(tmp_path) == [1, 2, 3, 4]
    # A late notification of an old checkpoint, or a repeated one, changes nothing.
    restored.notify_checkpoint_complete(1)
    restored.notify_checkpoint_complete(2)
    assert read_values(tmp_path) == [1, 2, 3, 4]


def test_exactly_once_size_rolling_keeps_parts_hidden_until_the_checkpoint(tmp_path):
    sink = FileSink(tmp_path, "jsonl", EO, RollingPolicy(max_part_size=1))
    op = operator(sink)
    for v in range(5):
        op.process(batch([v]))
    assert visible(tmp_path) == [] and len(hidden(tmp_path)) == 5
    op.snapshot_state(7)
    op.notify_checkpoint_complete(7)
    assert read_values(tmp_path) == [0, 1, 2, 3, 4]
    assert len(visible(tmp_path)) == 5 and hidden(tmp_path) == []
