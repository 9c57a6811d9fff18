"""A subtask acknowledges a push once it admits the message, not once it has processed
it: the sender may run ahead of a busy receiver by what is in flight, on a real Ray.

Each channel here carries one message at a time (bytes limits of 1, every batch sent at
once, no latency markers). A push runs on the receiver's loop, so none is admitted while
the slow operator holds that loop processing a batch: the receiver's buffer is empty
whenever it is done with a batch, and the next push (sent meanwhile) is admitted then
and taken at once. While the slow operator processes batch ``k``, batch ``k + 1`` is in
flight, so the operator before it has processed ``k + 2`` and waits with it: a lead of
3. An acknowledgement that waited for the processing of the message it admitted (the
reader is woken before the push that woke it has returned) would send ``k + 1`` only
once ``k`` is processed: a lead of 2, both subtasks waiting for each other at every
message.

Latency markers are off: each is a message of its own on a channel, and where one falls
moves a lead by one either way.
"""

from __future__ import annotations

import time

from rayflow import NumberSequenceSource, StreamExecutionEnvironment
from sinks.basic import CollectSink

BATCHES = 8
ROWS = 10
SLOW_S = 0.5  # per batch, in the last operator: the one before it is fast


def test_a_busy_receiver_acknowledges_what_it_admitted_before_it_processes_it(tmp_path):
    progress = tmp_path / "read"
    ahead = tmp_path / "ahead"
    progress.write_text("")

    def note(batch):
        with open(progress, "a") as f:
            f.write(f"{batch.column(0)[0].as_py() // ROWS}\n")
        return batch

    def slow(batch):
        index = batch.column(0)[0].as_py() // ROWS
        time.sleep(SLOW_S)
        noted = len(progress.read_text().splitlines())
        with open(ahead, "a") as f:
            f.write(f"{index} {noted}\n")
        return batch

    env = StreamExecutionEnvironment.get_execution_environment().set_parallelism(1)
    env.disable_operator_chaining()
    env.set_buffer_limits(channel_capacity=8, send_window=8, channel_bytes=1)
    env.set_output_buffer_size(1)
    env.set_latency_tracking_interval(0)
    sink = CollectSink()
    (
        env.from_source(NumberSequenceSource(0, BATCHES * ROWS - 1, batch_size=ROWS), "numbers")
        .map_batches(note, name="Note")
        .map_batches(slow, name="Slow")
        .sink_to(sink)
    )
    result = env.execute("acknowledged-on-admission")
    assert sorted(result.sink_results["CollectSink"].column("value").to_pylist()) == list(
        range(BATCHES * ROWS)
    )
    seen = [tuple(map(int, line.split())) for line in ahead.read_text().splitlines()]
    assert [index for index, _ in seen] == list(range(BATCHES))
    # Batches the operator before had processed when the slow one was done with batch k,
    # while there were more to read: k + 3 (0..k+2) when acknowledgements are prompt,
    # k + 2 when the acknowledgement of k + 1 waits until batch k is processed.
    leads = [noted - index for index, noted in seen if index + 3 <= BATCHES]
    assert min(leads) >= 3, seen
