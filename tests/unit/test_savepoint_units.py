"""Savepoints without Ray: the versioned state format (old blobs load, unknown versions
and unreadable state fail with clear messages), a savepoint directory that restores after
being moved, and matching state to operators by uid."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import sys
import types
import warnings

import pytest

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from rayflow.checkpoint.metadata import (
    CheckpointMetadata,
    SubtaskStateMeta,
    UnsupportedMetadataVersion,
)
from rayflow.checkpoint.savepoint import is_savepoint, load_savepoint, write_savepoint
from rayflow.checkpoint.state_format import (
    StateFormatError,
    decode_operator_states,
    encode_operator_states,
)
from rayflow.checkpoint.state_mapping import (
    MissingUidWarning,
    check_state_mapping,
    unmatched_state,
)
from rayflow.checkpoint.storage import CheckpointStorage
from rayflow.cli import main as cli_main
from rayflow.runtime.channel_state import decode_snapshot, encode_snapshot
from rayflow.runtime.restore import state_handles
from sinks.basic import CollectSink

# --- the state format --------------------------------------------------------------------


def test_state_round_trips_and_old_blobs_still_load():
    states = {"sum": {"k": 1}, "map": None}
    decoded = decode_operator_states(encode_operator_states(states))
    assert dict(decoded) == states and "sum" in decoded and len(decoded) == 2
    old = pickle.dumps(states)  # format 1: a bare pickle
    assert dict(decode_operator_states(old)) == states
    # with channel state around it (unaligned checkpoints)
    operators, channels = decode_snapshot(encode_snapshot(encode_operator_states(states), {}))
    assert dict(operators) == states and channels == {}


def test_an_unknown_state_version_is_a_clear_error():
    blob = bytearray(encode_operator_states({"sum": 1}))
    blob[len(b"RAYFLOW-STATE\n")] = 9
    with pytest.raises(StateFormatError, match="state format version 9 is not supported"):
        decode_operator_states(bytes(blob), "chk-3/a0-v1-s0.state")
    with pytest.raises(StateFormatError, match="not a rayflow state blob"):
        decode_operator_states(b"garbage", "x")


def test_damaged_state_is_an_error_naming_its_operators_that_no_restart_fixes():
    from rayflow.recoverability import classify

    names = {"sum": "Running sum", "map": "Tag"}
    blob = bytearray(encode_operator_states({"sum": 1}))
    blob[len(b"RAYFLOW-STATE\n")] = 9
    with pytest.raises(StateFormatError, match=r"a0-v1-s0.state \(read for .*'Running sum'"):
        decode_operator_states(bytes(blob), "a0-v1-s0.state", names)
    # with in-flight data around it (unaligned checkpoints), torn
    framed = encode_snapshot(encode_operator_states({"sum": 1}), {})
    with pytest.raises(StateFormatError, match=r"(?s)'Tag'.*cannot be read") as damaged:
        decode_snapshot(framed[: len(framed) // 2], "a0-v1-s0.state", names)
    assert classify(damaged.value) is not None  # not recoverable: the job fails at once


def test_state_of_a_class_that_is_gone_names_the_operator_and_only_fails_when_read():
    module = types.ModuleType("gone_module")

    class Total:
        pass

    Total.__module__ = "gone_module"
    Total.__qualname__ = "Total"
    module.Total = Total
    sys.modules["gone_module"] = module
    try:
        blob = encode_operator_states({"total": Total(), "count": 3})
    finally:
        del sys.modules["gone_module"]
    states = decode_operator_states(blob, "savepoint x", {"total": "Running total"})
    assert states["count"] == 3  # other operators' state still loads
    with pytest.raises(StateFormatError, match=r"'Running total' \(uid 'total'\).*gone_module"):
        states["total"]


def test_metadata_of_an_unknown_version_is_a_clear_error():
    raw = {"format_version": 99, "checkpoint_id": 1}
    with pytest.raises(UnsupportedMetadataVersion, match="version 99 is not supported"):
        CheckpointMetadata.from_bytes(pickle.dumps(raw), "savepoint y")
    with pytest.raises(UnsupportedMetadataVersion, match="cannot be read"):
        CheckpointMetadata.from_bytes(b"\x80\x05not a pickle", "savepoint y")


# --- savepoint directories ------------------------------------------------------------------


def metadata(tmp_path) -> CheckpointMetadata:
    run = CheckpointStorage(str(tmp_path / "chk"), "job", run_id="run-20260101T000000-abcdef01")
    path = run.write_blob(7, "a0-v0-s0.state", encode_operator_states({"sum": {"a": 1}}))
    return CheckpointMetadata(
        checkpoint_id=7,
        job_name="job",
        run_id=run.run_id,
        attempt=0,
        trigger_time=1.0,
        completed_at=2.0,
        final=False,
        subtasks={
            (0, 0): SubtaskStateMeta(
                path, 10, ("sum", "map"), 1, "Sum", stateful_uids=("sum", "source-0")
            )
        },
        source_splits={"source-0": []},
        operator_names={"sum": "Sum", "map": "Map", "source-0": "numbers"},
    )


def test_a_savepoint_is_self_contained_and_restores_after_a_move(tmp_path, capsys):
    meta = metadata(tmp_path)
    blob = open(meta.subtasks[(0, 0)].path, "rb").read()
    where = write_savepoint(str(tmp_path / "sp" / "one"), meta, {(0, 0): blob})
    assert sorted(os.listdir(where)) == ["_metadata", "a0-v0-s0.state"]
    shutil.rmtree(tmp_path / "chk")  # nothing of the run is needed
    shutil.move(where, tmp_path / "elsewhere")
    moved = str(tmp_path / "elsewhere")
    assert is_savepoint(moved) and not is_savepoint(str(tmp_path))
    loaded = load_savepoint(moved)
    assert loaded.savepoint and loaded.run_id == meta.run_id and loaded.checkpoint_id == 7
    entry = loaded.subtasks[(0, 0)]
    assert entry.path == f"{moved}/a0-v0-s0.state"
    assert (
        entry.stateful_uids == ("sum", "source-0") and entry.uids_with_state == entry.stateful_uids
    )
    data = loaded.blob_storage.read_blob(entry.path)
    assert dict(decode_operator_states(data)) == {"sum": {"a": 1}}
    assert cli_main(["checkpoints", moved]) == 0
    listing = capsys.readouterr().out
    assert f"savepoint of job 'job' run {meta.run_id} (its checkpoint 7)" in listing
    assert "Sum" in listing
    # written again (a job master that took over after the writer died): left as it is;
    # another savepoint is never written over it
    before = open(os.path.join(moved, "_metadata"), "rb").read()
    assert write_savepoint(moved, meta, {(0, 0): b"other bytes"}) == moved
    assert open(os.path.join(moved, "_metadata"), "rb").read() == before
    assert open(entry.path, "rb").read() == blob
    other = dataclasses.replace(meta, checkpoint_id=8)
    with pytest.raises(Exception, match="another savepoint is there already"):
        write_savepoint(moved, other, {(0, 0): blob})
    with pytest.raises(FileNotFoundError, match="no savepoint here"):
        load_savepoint(str(tmp_path / "nothing"))


def test_a_savepoint_written_into_its_partial_directory_is_whole(tmp_path):
    """The writer died after some blobs (no metadata): the directory is no savepoint, and
    writing it again there makes it whole."""
    meta = metadata(tmp_path)
    blob = open(meta.subtasks[(0, 0)].path, "rb").read()
    where = tmp_path / "sp" / "partial"
    where.mkdir(parents=True)
    (where / "a0-v0-s0.state").write_bytes(blob[:5])  # torn
    assert not is_savepoint(str(where))
    with pytest.raises(FileNotFoundError, match="no savepoint here"):
        load_savepoint(str(where))
    assert write_savepoint(str(where), meta, {(0, 0): blob}) == str(where)
    loaded = load_savepoint(str(where))
    data = loaded.blob_storage.read_blob(loaded.subtasks[(0, 0)].path)
    assert dict(decode_operator_states(data)) == {"sum": {"a": 1}}


def test_state_handles_read_a_savepoint_through_its_own_storage(tmp_path):
    meta = metadata(tmp_path)
    blob = open(meta.subtasks[(0, 0)].path, "rb").read()
    where = write_savepoint(str(tmp_path / "sp"), meta, {(0, 0): blob})
    env = StreamExecutionEnvironment.get_execution_environment()
    env.from_source(NumberSequenceSource(0, 9), "numbers").key_by("value").sum("value").uid(
        "sum"
    ).sink_to(CollectSink())
    graph = env.get_job_graph()
    loaded = load_savepoint(where)
    vertex = next(v for v in graph.vertices.values() if any(o.uid == "sum" for o in v.operators))
    (handle,) = state_handles(vertex, loaded)
    assert handle.storage is loaded.blob_storage and handle.path.startswith(where)


# --- matching state to operators by uid -------------------------------------------------------


def job(with_sum_uid: str | None, extra_map: bool = False) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment()
    stream = env.from_source(NumberSequenceSource(0, 9), "numbers").uid("source-0")
    if extra_map:
        stream = stream.map_batches(lambda b: b, name="added").uid("added")
    summed = stream.key_by("value").sum("value")
    if with_sum_uid is not None:
        summed = summed.uid(with_sum_uid)
    summed.sink_to(CollectSink(), name="out").uid("out")
    return env


def test_state_is_matched_by_uid_and_an_added_operator_starts_empty(tmp_path):
    meta = metadata(tmp_path)
    env = job("sum", extra_map=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_state_mapping(env._plan, env.get_job_graph(), meta, False, "restore")
    assert unmatched_state(env.get_job_graph(), meta) == {}


def test_state_nobody_takes_is_refused_unless_allowed(tmp_path):
    meta = metadata(tmp_path)
    env = job("sum-renamed")
    assert unmatched_state(env.get_job_graph(), meta) == {"sum": "Sum"}  # "map": no state
    with pytest.raises(ValueError, match=r"'Sum' \(uid 'sum'\).*allow_non_restored_state"):
        check_state_mapping(env._plan, env.get_job_graph(), meta, False, "restore")
    check_state_mapping(env._plan, env.get_job_graph(), meta, True, "restore")


def test_operators_without_uid_warn_and_duplicate_uids_are_refused(tmp_path):
    meta = metadata(tmp_path)
    env = job(None)
    with pytest.warns(MissingUidWarning, match=r"\['Sum'\]"):
        check_state_mapping(env._plan, env.get_job_graph(), meta, True, "restore")
    env = job("out")  # refused when the job graph is built, before any restore
    with pytest.raises(ValueError, match=r"uid 'out' names two operators, 'Sum' and 'out'"):
        check_state_mapping(env._plan, env.get_job_graph(), meta, True, "restore")


def test_a_stateless_operator_without_uid_is_not_warned_about(tmp_path):
    meta = metadata(tmp_path)
    env = StreamExecutionEnvironment.get_execution_environment()
    (
        env.from_source(NumberSequenceSource(0, 9), "numbers")
        .uid("source-0")
        .map_batches(lambda b: b, name="relay")  # stateless, no uid: nothing to match
        .key_by("value")
        .sum("value")
        .uid("sum")
        .sink_to(CollectSink(), name="out")
        .uid("out")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_state_mapping(env._plan, env.get_job_graph(), meta, False, "restore")
    # the same job with its keyed sum left without a uid is warned about, by name
    env = job(None)
    with pytest.warns(MissingUidWarning, match=r"operators \['Sum'\] have no"):
        check_state_mapping(env._plan, env.get_job_graph(), meta, True, "restore")
