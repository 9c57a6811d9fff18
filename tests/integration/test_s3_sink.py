"""The S3 multipart file sink against a real S3 API (moto's server on 127.0.0.1).

Transaction-level tests drive the sink directly (no job): multipart round trip,
commit idempotence (a repeated complete; a complete after the upload is gone),
abort and abort_lingering, transient-error retries. Job tests run real Ray jobs
in every format and delivery guarantee and read the committed objects back.
"""

from __future__ import annotations

import collections
import hashlib
import pickle
import time

import pyarrow as pa
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError

import tests.s3_server as _s3_fixtures
from rayflow import DeliveryGuarantee, NumberSequenceSource, StreamExecutionEnvironment
from rayflow.config import RestartStrategies
from rayflow.sink import RollingPolicy, SinkContext, UnsupportedGuaranteeError
from sinks.s3 import (
    MIN_PART_SIZE,
    TRANSACTION_METADATA,
    S3CommitError,
    S3Committable,
    S3FileSink,
)
from tests.s3_server import S3Server, decode, parts_of

# The shared moto server fixtures (see tests/s3_server.py).
s3_server = _s3_fixtures.s3_server
s3_bucket = _s3_fixtures.s3_bucket

PAD_HEX = 1500  # characters of incompressible padding per record


def pad_of(value: int) -> str:
    return hashlib.shake_256(str(value).encode()).hexdigest(PAD_HEX // 2)


def padded(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Adds an incompressible, value-derived padding column (checks byte integrity too)."""
    values = batch.column("value").to_pylist()
    return batch.append_column("pad", pa.array([pad_of(v) for v in values]))


def context(subtask: int = 0, job: str = "unit", attempt: int = 0) -> SinkContext:
    return SinkContext(job, "s3-sink", subtask, 2, attempt)


def make_sink(server: S3Server, bucket: str, fmt: str = "jsonl", **kwargs) -> S3FileSink:
    return S3FileSink(bucket, "out/", format=fmt, **server.sink_options(), **kwargs)


def rows(start: int, count: int) -> pa.RecordBatch:
    return padded(pa.record_batch({"value": pa.array(range(start, start + count), pa.int64())}))


def fail_first(sink: S3FileSink, operation: str, responses: list[tuple[int, str]]) -> list:
    """Make the sink's client receive these (status, error code) answers, one per call of
    ``operation``, before real ones: botocore sees them exactly as S3 errors."""
    calls: list[str] = []
    queue = list(responses)

    def before_send(request, **_):
        calls.append(operation)
        if not queue:
            return None
        status, code = queue.pop(0)
        body = (
            f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
            f"<Message>injected {code}</Message></Error>"
        ).encode()

        class Raw:
            def stream(self, **_):
                yield body

        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, Raw())

    sink.client.meta.events.register(f"before-send.s3.{operation}", before_send)
    return calls


# --- options -------------------------------------------------------------------------------


def test_part_size_below_the_s3_minimum_is_refused():
    with pytest.raises(ValueError, match="part_size"):
        S3FileSink("bucket", part_size=1024 * 1024)
    with pytest.raises(ValueError, match="format"):
        S3FileSink("bucket", format="avro")


def test_repr_hides_credentials_and_pickling_drops_the_client(s3_server, s3_bucket):
    sink = make_sink(s3_server, s3_bucket)
    sink.client.list_objects_v2(Bucket=s3_bucket)
    text = repr(sink)
    assert s3_server.credentials["aws_secret_access_key"] not in text
    assert s3_server.credentials["aws_access_key_id"] not in text
    assert "***" in text and s3_bucket in text
    clone = pickle.loads(pickle.dumps(sink))
    assert clone._client is None
    clone.client.list_objects_v2(Bucket=s3_bucket)  # a new client, created on use


def test_exactly_once_with_checkpointing_off_is_refused_when_the_job_is_built():
    env = StreamExecutionEnvironment.get_execution_environment()
    sink = S3FileSink("bucket", delivery_guarantee=DeliveryGuarantee.EXACTLY_ONCE)
    env.from_source(NumberSequenceSource(0, 9)).sink_to(sink)
    with pytest.raises(UnsupportedGuaranteeError, match="checkpointing is off"):
        env.execute("s3-no-checkpoints")


def test_checkpoints_longer_than_the_upload_lifetime_are_refused():
    env = StreamExecutionEnvironment.get_execution_environment()
    env.enable_checkpointing(60_000)
    sink = S3FileSink("bucket", max_transaction_lifetime_s=30)
    env.from_source(NumberSequenceSource(0, 9)).sink_to(sink)
    with pytest.raises(UnsupportedGuaranteeError, match="drops transactions after 30 s"):
        env.execute("s3-lifetime")


# --- transactions, driven directly -------------------------------------------------------------


def test_multipart_transaction_is_invisible_until_commit(s3_server, s3_bucket):
    sink = make_sink(s3_server, s3_bucket)
    txn = sink.begin_transaction(context(), 7)
    assert sink.is_empty(txn)
    for start in range(0, 6000, 1000):  # ~9 MB of JSON lines
        sink.write(txn, rows(start, 1000))
    assert sink.transaction_size(txn) > MIN_PART_SIZE
    assert s3_server.objects(s3_bucket) == []
    assert len(s3_server.open_uploads(s3_bucket)) == 1
    committable = sink.pre_commit(txn)
    assert committable.key == f"out/{sink.transaction_prefix(context())}00000007.jsonl"
    assert len(committable.parts) == 2 and committable.records == 6000
    assert s3_server.objects(s3_bucket) == []  # pre-committed is still invisible
    sink.commit(committable)
    [obj] = s3_server.objects(s3_bucket)
    assert obj["Size"] == committable.size and parts_of(obj) == 2
    table = decode(s3_server.get(s3_bucket, obj["Key"]), "jsonl")
    assert table.column("value").to_pylist() == list(range(6000))
    assert table.column("pad").to_pylist() == [pad_of(v) for v in range(6000)]
    assert s3_server.open_uploads(s3_bucket) == []


def test_commit_is_idempotent(s3_server, s3_bucket):
    sink = make_sink(s3_server, s3_bucket, "parquet")
    txn = sink.begin_transaction(context(), 0)
    sink.write(txn, rows(0, 4000))
    committable = pickle.loads(pickle.dumps(sink.pre_commit(txn)))
    assert len(committable.parts) == 2  # a full 5 MiB part, then the rest and the footer
    sink.commit(committable)
    sink.commit(committable)  # moto completes again
    # Real S3 forgets a completed upload: the repeated complete answers NoSuchUpload, and a
    # HEAD of the object (right size, right multipart ETag) says it is already committed.
    calls = fail_first(sink, "CompleteMultipartUpload", [(404, "NoSuchUpload")])
    sink.commit(committable)
    assert calls == ["CompleteMultipartUpload"]
    [obj] = s3_server.objects(s3_bucket)
    assert decode(s3_server.get(s3_bucket, obj["Key"]), "parquet").num_rows == 4000


def test_commit_after_the_upload_is_gone_checks_the_object(s3_server, s3_bucket):
    from botocore.config import Config

    no_retries = Config(retries={"mode": "standard", "max_attempts": 1})
    sink = make_sink(s3_server, s3_bucket, config=no_retries)
    committables = []
    for sequence in range(3):
        txn = sink.begin_transaction(context(), sequence)
        sink.write(txn, rows(sequence * 100, 100))
        committables.append(sink.pre_commit(txn))
    client = s3_server.client()

    # Upload gone, the object there with the committable's size and transaction token
    # (as CompleteMultipartUpload left it): committed before.
    done = committables[0]
    client.put_object(
        Bucket=s3_bucket,
        Key=done.key,
        Body=b"x" * done.size,
        Metadata={TRANSACTION_METADATA: done.transaction_token},
    )
    sink.abort(done)
    sink.commit(done)  # moto answers 500 for the aborted upload; HEAD decides
    # The same size without this transaction's token is someone else's object.
    client.put_object(Bucket=s3_bucket, Key=done.key, Body=b"y" * done.size)
    with pytest.raises(S3CommitError, match="not by this transaction"):
        sink.commit(done)

    # Upload gone and no object: the output is lost, say so loudly.
    lost = committables[1]
    sink.abort(lost)
    with pytest.raises(S3CommitError, match="no object exists"):
        sink.commit(lost)

    # Upload gone and some other object there: not ours.
    other = committables[2]
    client.put_object(Bucket=s3_bucket, Key=other.key, Body=b"something else")
    sink.abort(other)
    with pytest.raises(S3CommitError, match="bytes, not the"):
        sink.commit(other)


def test_objects_carry_their_transaction_token(s3_server, s3_bucket):
    sink = make_sink(s3_server, s3_bucket)
    tokens = []
    for sequence in range(2):
        txn = sink.begin_transaction(context(), sequence)
        sink.write(txn, rows(0, 10))
        committable = sink.pre_commit(txn)
        sink.commit(committable)
        head = s3_server.client().head_object(Bucket=s3_bucket, Key=committable.key)
        assert head["Metadata"] == {TRANSACTION_METADATA: committable.transaction_token}
        tokens.append(committable.transaction_token)
    assert len(set(tokens)) == 2 and all(len(t) == 32 for t in tokens)


def test_repeated_commit_refuses_an_object_of_the_same_size_from_another_transaction(
    s3_server, s3_bucket
):
    # The job run again under its name (or a replay) writes the same key with the same
    # bytes: same size, same multipart ETag. Only the transaction token tells the objects
    # apart; the first transaction's repeated commit must not claim the second's object.
    def run() -> tuple[S3FileSink, S3Committable]:
        sink = make_sink(s3_server, s3_bucket, "parquet")
        txn = sink.begin_transaction(context(), 0)
        sink.write(txn, rows(0, 4000))
        committable = pickle.loads(pickle.dumps(sink.pre_commit(txn)))
        sink.commit(committable)
        return sink, committable

    first_sink, first = run()
    second_sink, second = run()  # replaces the object
    assert (first.key, first.size, first.expected_etag()) == (
        second.key,
        second.size,
        second.expected_etag(),
    )
    assert len(first.parts) == 2 and first.transaction_token != second.transaction_token
    # Real S3 forgets a completed upload: a repeated complete answers NoSuchUpload.
    fail_first(first_sink, "CompleteMultipartUpload", [(404, "NoSuchUpload")])
    with pytest.raises(S3CommitError, match="not by this transaction") as info:
        first_sink.commit(first)
    assert second.transaction_token in str(info.value)
    # The genuine repeated commit of the second transaction still succeeds.
    calls = fail_first(second_sink, "CompleteMultipartUpload", [(404, "NoSuchUpload")])
    second_sink.commit(second)
    assert calls == ["CompleteMultipartUpload"]
    head = s3_server.client().head_object(Bucket=s3_bucket, Key=second.key)
    assert head["Metadata"][TRANSACTION_METADATA] == second.transaction_token


def test_committables_without_a_token_fall_back_to_size_and_etag(s3_server, s3_bucket, caplog):
    sink = make_sink(s3_server, s3_bucket)
    txn = sink.begin_transaction(context(), 0)
    sink.write(txn, rows(0, 100))
    committable = sink.pre_commit(txn)
    sink.commit(committable)
    # A committable pickled by an older version: no transaction_token in its state.
    old = object.__new__(S3Committable)
    old.__dict__.update({k: v for k, v in committable.__dict__.items() if k != "transaction_token"})
    old = pickle.loads(pickle.dumps(old))
    assert "transaction_token" not in old.__dict__ and old.transaction_token is None
    fail_first(sink, "CompleteMultipartUpload", [(404, "NoSuchUpload")])
    with caplog.at_level("WARNING", logger="rayflow.sinks.s3"):
        sink.commit(old)  # size and multipart ETag match: taken as committed, with a warning
    assert "no transaction token" in caplog.text and "ETag" in caplog.text


def test_abort_and_abort_transaction(s3_server, s3_bucket):
    sink = make_sink(s3_server, s3_bucket, "csv")
    empty = sink.begin_transaction(context(), 0)
    assert sink.is_empty(empty)
    sink.abort_transaction(empty)  # nothing was written: no upload was ever created
    assert s3_server.open_uploads(s3_bucket) == []

    open_txn = sink.begin_transaction(context(), 1)
    sink.write(open_txn, rows(0, 10))
    assert len(s3_server.open_uploads(s3_bucket)) == 1
    sink.abort_transaction(open_txn)
    assert s3_server.open_uploads(s3_bucket) == []

    txn = sink.begin_transaction(context(), 2)
    sink.write(txn, rows(0, 10))
    committable = sink.pre_commit(txn)
    sink.abort(committable)
    sink.abort(committable)  # already gone is success
    assert s3_server.open_uploads(s3_bucket) == [] and s3_server.objects(s3_bucket) == []


def test_close_aborts_open_transactions_but_not_pre_committed_ones(s3_server, s3_bucket):
    sink = make_sink(s3_server, s3_bucket)
    kept = sink.begin_transaction(context(), 0)
    sink.write(kept, rows(0, 10))
    committable = sink.pre_commit(kept)
    dropped = sink.begin_transaction(context(), 1)
    sink.write(dropped, rows(10, 10))
    sink.close()
    assert [u["UploadId"] for u in s3_server.open_uploads(s3_bucket)] == [committable.upload_id]
    sink.commit(committable)
    assert len(s3_server.objects(s3_bucket)) == 1


def test_abort_lingering_aborts_only_this_subtasks_uploads_not_kept(s3_server, s3_bucket):
    sink = make_sink(s3_server, s3_bucket)
    mine = []
    for sequence in range(3):
        txn = sink.begin_transaction(context(1), sequence)
        sink.write(txn, rows(sequence, 1))
        mine.append(sink.pre_commit(txn))
    open_txn = sink.begin_transaction(context(1), 3)
    sink.write(open_txn, rows(3, 1))
    others = []
    for subtask in (0, 10):  # "...-1-" must not match "...-10-"
        txn = sink.begin_transaction(context(subtask), 0)
        sink.write(txn, rows(0, 1))
        others.append(sink.pre_commit(txn))
    other_job = S3FileSink(s3_bucket, "out/", **s3_server.sink_options())
    txn = other_job.begin_transaction(context(1, job="other"), 0)
    other_job.write(txn, rows(0, 1))
    others.append(other_job.pre_commit(txn))

    aborted = sink.abort_lingering(context(1), keep=[mine[1]])
    assert aborted == 3  # mine[0], mine[2] and the open one
    left = {u["UploadId"] for u in s3_server.open_uploads(s3_bucket)}
    assert left == {mine[1].upload_id} | {c.upload_id for c in others}
    assert sink.abort_lingering(context(1), keep=[mine[1]]) == 0
    sink.commit(mine[1])
    assert [o["Key"] for o in s3_server.objects(s3_bucket)] == [mine[1].key]


def test_transient_errors_are_retried_by_botocore(s3_server, s3_bucket):
    sink = make_sink(s3_server, s3_bucket)
    part_calls = fail_first(sink, "UploadPart", [(503, "SlowDown")])
    complete_calls = fail_first(
        sink, "CompleteMultipartUpload", [(500, "InternalError"), (503, "SlowDown")]
    )
    txn = sink.begin_transaction(context(), 0)
    sink.write(txn, rows(0, 100))
    committable = sink.pre_commit(txn)
    sink.commit(committable)
    assert len(part_calls) == 2 and len(complete_calls) == 3  # two errors, then success
    assert s3_server.objects(s3_bucket)[0]["Key"] == committable.key
    assert s3_server.open_uploads(s3_bucket) == []


# --- jobs ------------------------------------------------------------------------------------

N = 16_000
BATCH = 4000  # ~6 MB of records per batch: every transaction spans at least two parts


def job(
    server: S3Server,
    sink: S3FileSink,
    n: int = N,
    checkpoint_ms: int | None = 300,
    storage: str | None = None,
    batch_size: int = BATCH,
) -> StreamExecutionEnvironment:
    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(2)
    if checkpoint_ms is not None:
        env.enable_checkpointing(checkpoint_ms)
        env.get_checkpoint_config().set_checkpoint_storage(storage)
    env.set_restart_strategy(RestartStrategies.no_restart())
    (
        env.from_source(NumberSequenceSource(0, n - 1, batch_size=batch_size), "numbers")
        .map_batches(padded, name="pad")
        .sink_to(sink, name="s3")
        .uid("s3")
    )
    return env


def check_records(table: pa.Table, n: int) -> collections.Counter:
    values = table.column("value").to_pylist()
    counts = collections.Counter(values)
    assert set(counts) == set(range(n)), "records lost"
    pads = table.column("pad").to_pylist()
    assert all(p == pad_of(v) for v, p in zip(values, pads, strict=True)), "records corrupted"
    return counts


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_exactly_once_job_writes_every_record_once(fmt, s3_server, s3_bucket, tmp_path):
    sink = S3FileSink(s3_bucket, "eo", format=fmt, **s3_server.sink_options())
    started = time.time()
    result = job(s3_server, sink, storage=str(tmp_path)).execute(f"s3-eo-{fmt}-{time.time_ns()}")
    elapsed = time.time() - started
    objects = s3_server.read_objects(s3_bucket, "eo/", fmt)
    table = pa.concat_tables([t for _, t in objects])
    counts = check_records(table, N)
    assert table.num_rows == N and max(counts.values()) == 1
    assert s3_server.open_uploads(s3_bucket) == []
    assert any(parts_of(obj) > 1 for obj, _ in objects)
    assert all(obj["Key"].endswith(f".{fmt}") for obj, _ in objects)
    assert result.sink_result(sink) >= len(objects)
    size = sum(obj["Size"] for obj, _ in objects)
    print(
        f"{fmt}: {len(objects)} objects, {sum(parts_of(o) for o, _ in objects)} parts, "
        f"{size / 2**20:.1f} MiB in {elapsed:.1f} s ({size / 2**20 / elapsed:.1f} MiB/s), "
        f"{len(result.completed_checkpoints)} checkpoints"
    )


def test_at_least_once_job_commits_at_every_barrier(s3_server, s3_bucket, tmp_path):
    sink = S3FileSink(
        s3_bucket,
        "alo",
        delivery_guarantee=DeliveryGuarantee.AT_LEAST_ONCE,
        **s3_server.sink_options(),
    )
    job(s3_server, sink, storage=str(tmp_path)).execute(f"s3-alo-{time.time_ns()}")
    table = s3_server.read_table(s3_bucket, "alo/", "jsonl")
    counts = check_records(table, N)  # nothing lost (no failure here: nothing repeated either)
    assert table.num_rows == N and max(counts.values()) == 1
    assert s3_server.open_uploads(s3_bucket) == []


def test_none_job_without_checkpoints_rolls_by_size(s3_server, s3_bucket):
    sink = S3FileSink(
        s3_bucket,
        "none",
        delivery_guarantee=DeliveryGuarantee.NONE,
        rolling_policy=RollingPolicy(max_part_size=8 * 2**20),
        **s3_server.sink_options(),
    )
    job(s3_server, sink, checkpoint_ms=None).execute(f"s3-none-{time.time_ns()}")
    objects = s3_server.read_objects(s3_bucket, "none/", "jsonl")
    table = pa.concat_tables([t for _, t in objects])
    check_records(table, N)
    assert table.num_rows == N
    assert len(objects) >= 2  # rolled by size, committed as it rolled
    assert s3_server.open_uploads(s3_bucket) == []


class FlakyCompleteS3FileSink(S3FileSink):
    """Its client fails the first ``failures`` CompleteMultipartUpload calls of each process
    with InternalError / SlowDown, past botocore's retries: the runtime's commit retry
    has to carry the commit."""

    failures = 3

    def _make_client(self):
        client = super()._make_client()
        real = client.complete_multipart_upload
        left = [self.failures]

        def complete(**kwargs):
            if left[0] > 0:
                left[0] -= 1
                code = "SlowDown" if left[0] % 2 else "InternalError"
                raise ClientError(
                    {
                        "Error": {"Code": code, "Message": "injected"},
                        "ResponseMetadata": {"HTTPStatusCode": 503 if code == "SlowDown" else 500},
                    },
                    "CompleteMultipartUpload",
                )
            return real(**kwargs)

        client.complete_multipart_upload = complete
        return client


def test_commit_survives_transient_errors_through_the_commit_retry(s3_server, s3_bucket, tmp_path):
    sink = FlakyCompleteS3FileSink(s3_bucket, "flaky", **s3_server.sink_options())
    result = job(s3_server, sink, n=4000, storage=str(tmp_path), batch_size=500).execute(
        f"s3-flaky-{time.time_ns()}"
    )
    assert result.restarts == 0
    table = s3_server.read_table(s3_bucket, "flaky/", "jsonl")
    counts = check_records(table, 4000)
    assert table.num_rows == 4000 and max(counts.values()) == 1
    assert s3_server.open_uploads(s3_bucket) == []
