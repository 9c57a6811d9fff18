"""Build-time guarantee checks: asking for more than a job can give is an error."""

import pytest

from rayflow import DeliveryGuarantee, NumberSequenceSource, StreamExecutionEnvironment
from rayflow.config import CheckpointingMode
from rayflow.sink import Sink, SinkContext, SinkWriter, UnsupportedGuaranteeError
from sinks.basic import CollectSink, PrintSink


def job(sink, interval=None, mode=CheckpointingMode.EXACTLY_ONCE):
    env = StreamExecutionEnvironment.get_execution_environment()
    if interval is not None:
        env.enable_checkpointing(interval, mode)
    env.from_source(NumberSequenceSource(0, 9)).sink_to(sink, name="out")
    return env


def test_exactly_once_with_checkpointing_off_fails_at_build():
    env = job(CollectSink(DeliveryGuarantee.EXACTLY_ONCE))
    with pytest.raises(UnsupportedGuaranteeError, match="checkpointing is off"):
        env.get_job_graph()


def test_at_least_once_with_checkpointing_off_fails_at_build():
    env = job(CollectSink(DeliveryGuarantee.AT_LEAST_ONCE))
    with pytest.raises(UnsupportedGuaranteeError, match="enable_checkpointing"):
        env.get_job_graph()


def test_exactly_once_sink_with_at_least_once_checkpoints_fails():
    env = job(CollectSink(DeliveryGuarantee.EXACTLY_ONCE), 100, CheckpointingMode.AT_LEAST_ONCE)
    with pytest.raises(UnsupportedGuaranteeError, match="AT_LEAST_ONCE"):
        env.get_job_graph()


def test_sink_without_transactions_cannot_be_asked_for_exactly_once():
    with pytest.raises(UnsupportedGuaranteeError, match="PrintSink cannot give EXACTLY_ONCE"):
        PrintSink(DeliveryGuarantee.EXACTLY_ONCE)


def test_transaction_lifetime_shorter_than_interval_fails():
    class ShortLived(CollectSink):
        max_transaction_lifetime_s = 5.0

    env = job(ShortLived(DeliveryGuarantee.EXACTLY_ONCE), 10_000)
    with pytest.raises(UnsupportedGuaranteeError, match="drops transactions after 5 s"):
        env.get_job_graph()


@pytest.mark.parametrize(
    ("interval", "mode", "words"),
    [
        (None, None, "at-most-once"),
        (100, CheckpointingMode.AT_LEAST_ONCE, "at-least-once"),
        (100, CheckpointingMode.EXACTLY_ONCE, "exactly-once effect"),
    ],
)
def test_open_guarantee_takes_the_strongest_the_job_gives_and_says_so(interval, mode, words):
    sink = CollectSink()
    env = job(sink, interval, mode or CheckpointingMode.EXACTLY_ONCE)
    assert env.guarantees()["out"].startswith(words)
    assert f"sink 'out': {words}" in env.explain()


def test_plain_sink_is_never_described_as_more_than_at_most_once():
    class Plain(Sink):
        def create_writer(self, context: SinkContext) -> SinkWriter:
            raise NotImplementedError

    env = job(Plain(), 100)
    assert env.guarantees()["out"].startswith("at-most-once")
