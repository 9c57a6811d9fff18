"""The windowed workload on PyFlink SQL (``TUMBLE``) or Bytewax (``fold_window``); run
inside the peer's own venv by ``benchmarks/windowed.py``::

    /tmp/peers/pyflink/bin/python benchmarks/windowed_peers.py --engine pyflink-sql --records 2e6
    /tmp/peers/bytewax/bin/python benchmarks/windowed_peers.py --engine bytewax --records 2e6

The workload (as in ``windowed.py``): records ``i = 0..N-1``, key ``i % 1000``, value
``i``, event time ``i // 100`` ms (in order); tumbling 1 s event-time windows, the sum of
the values per key and window. Parallelism 1, no checkpoints.

* ``pyflink-sql``: a ``datagen`` sequence table with computed ``k`` and ``ts`` columns and
  ``WATERMARK FOR ts AS ts``; ``INSERT INTO blackhole SELECT k, window_start, SUM(i) FROM
  TABLE(TUMBLE(TABLE src, DESCRIPTOR(ts), INTERVAL '1' SECOND)) GROUP BY k, window_start,
  window_end``. Nothing reaches Python, so the result is not checked. The job time runs
  from after the JVM started (planning and deployment included) to the end of ``wait()``.
* ``bytewax``: a replayable range source (batches of 10,000) -> ``key_on`` ->
  ``windowing.fold_window`` with an ``EventClock`` (no wait; its clock held still, so the
  watermark follows event time alone) and a ``TumblingWindower`` ->
  a sink that keeps every (key, window) sum, checked against the direct sums. The job time
  is ``cli_main()``.

Prints one result line (``peers_common.RESULT_PREFIX`` + JSON).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers_common import KEYS, emit  # noqa: E402

MS_PER_RECORD_DIVISOR = 100  # event time of record i: i // 100 ms
WINDOW_MS = 1000


def expected_total(records: int) -> tuple[int, int]:
    """(number of (key, window) results, sum of all window sums)."""
    per_window = WINDOW_MS * MS_PER_RECORD_DIVISOR
    windows = 0
    for start in range(0, records, per_window):
        windows += min(KEYS, records - start)
    return windows, records * (records - 1) // 2


def run_pyflink_sql(records: int) -> dict:
    from pyflink.table import EnvironmentSettings, TableEnvironment

    t_env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    t_env.get_config().set("parallelism.default", "1")
    t_env.get_config().set("table.exec.mini-batch.enabled", "false")
    started = time.time()
    t_env.execute_sql(
        f"""CREATE TABLE src (
            i BIGINT,
            k AS i % {KEYS},
            ts AS TO_TIMESTAMP_LTZ(i / {MS_PER_RECORD_DIVISOR}, 3),
            WATERMARK FOR ts AS ts
        ) WITH (
            'connector' = 'datagen', 'rows-per-second' = '1000000000',
            'fields.i.kind' = 'sequence', 'fields.i.start' = '0',
            'fields.i.end' = '{records - 1}'
        )"""
    )
    t_env.execute_sql(
        "CREATE TABLE snk (k BIGINT, ws TIMESTAMP(3), s BIGINT) WITH ('connector' = 'blackhole')"
    )
    result = t_env.execute_sql(
        "INSERT INTO snk SELECT k, window_start, SUM(i) FROM "
        "TABLE(TUMBLE(TABLE src, DESCRIPTOR(ts), INTERVAL '1' SECOND)) "
        "GROUP BY k, window_start, window_end"
    )
    result.wait()
    seconds = time.time() - started
    return {"seconds": seconds, "check": "unchecked (blackhole sink)"}


def run_bytewax(records: int) -> dict:
    from datetime import datetime, timedelta, timezone

    import bytewax.operators as op
    import bytewax.operators.windowing as win
    from bytewax.dataflow import Dataflow
    from bytewax.inputs import FixedPartitionedSource, StatefulSourcePartition
    from bytewax.outputs import DynamicSink, StatelessSinkPartition
    from bytewax.run import cli_main

    epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)

    class Part(StatefulSourcePartition):
        def __init__(self, position: int) -> None:
            self.position = position

        def next_batch(self):
            if self.position >= records:
                raise StopIteration
            stop = min(records, self.position + 10_000)
            batch = list(range(self.position, stop))
            self.position = stop
            return batch

        def snapshot(self):
            return self.position

    class Range(FixedPartitionedSource):
        def list_parts(self):
            return ["all"]

        def build_part(self, step_id, for_part, resume_state):
            return Part(resume_state or 0)

    results: dict = {}

    class Keep(StatelessSinkPartition):
        def write_batch(self, items):
            for key, (window_id, total) in items:
                results[(key, window_id)] = total

    class KeepSink(DynamicSink):
        def build(self, step_id, worker_index, worker_count):
            return Keep()

    flow = Dataflow("windowed")
    numbers = op.input("numbers", flow, Range())
    keyed = op.key_on("key", numbers, lambda i: str(i % KEYS))
    clock = win.EventClock(
        lambda i: epoch + timedelta(milliseconds=i // MS_PER_RECORD_DIVISOR),
        wait_for_system_duration=timedelta(0),
        # event time alone moves the watermark (by default Bytewax also adds the system
        # time passed since the latest item, which makes in-order data late here)
        now_getter=lambda: epoch,
    )
    windower = win.TumblingWindower(length=timedelta(milliseconds=WINDOW_MS), align_to=epoch)
    sums = win.fold_window(
        "sum", keyed, clock, windower, lambda: 0, lambda acc, i: acc + i, lambda a, b: a + b
    )
    op.output("out", sums.down, KeepSink())
    started = time.time()
    cli_main(flow)
    seconds = time.time() - started
    windows, total = expected_total(records)
    got = (len(results), sum(results.values()))
    check = "ok" if got == (windows, total) else f"WRONG: {got} vs {(windows, total)}"
    return {"seconds": seconds, "check": check}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["pyflink-sql", "bytewax"], required=True)
    parser.add_argument("--records", type=float, default=2_000_000)
    args = parser.parse_args()
    args.records = int(args.records)
    run = run_pyflink_sql if args.engine == "pyflink-sql" else run_bytewax
    out = run(args.records)
    out.update(engine=args.engine, records=args.records)
    emit(out)


if __name__ == "__main__":
    main()
