"""The orders job: rayflow's main example; ``rayflow demo`` runs its pipeline.

A deterministic, replayable stream of synthetic orders flows through::

    NumberSequenceSource(0 .. N-1)
      -> map_batches(generate_orders)   vectorized: order_id, customer_id, product, amount_cents
      -> map(enrich)                    per record: region, amount_usd
      -> key_by("customer_id")          hash partitioning by key group
      -> sum("amount_cents")            vectorized running total per customer
      -> CollectSink                    rows back to the driver

Every column is a pure function of the sequence number, so the job can be
replayed and its result checked: the last running total emitted for each
customer must equal that customer's total computed directly with numpy.

The same pipeline with one output row per order (``build_order_stream``)::

    ... -> map(enrich) -> key_by("customer_id")
        -> reduce(add_running_total)    per record: the order with its customer's running total

is what ``rayflow demo`` runs under each delivery guarantee (``rayflow.demo``): every
order id must reach the sink's committed output exactly once. With ``--source kafka``
the orders come from a topic instead (``order_values`` fills it with the same orders,
as JSON; ``build_kafka_order_stream`` reads them back with a ``KafkaSource``): the
seed's Kafka -> enrich -> totals -> Kafka pipeline.

Run the totals job with ``python -m rayflow.jobs.orders`` or
``rayflow run --example orders``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from rayflow.argtypes import checkpoint_interval_ms
from rayflow.datastream import DataStream
from rayflow.environment import StreamExecutionEnvironment, ensure_ray
from rayflow.sources import NumberSequenceSource, Source
from sinks.basic import CollectSink

__all__ = [
    "PRODUCTS",
    "REGIONS",
    "order_columns",
    "generate_orders",
    "enrich",
    "start_running_total",
    "add_running_total",
    "ORDER_STREAM_COLUMNS",
    "ORDER_JSON_TYPE",
    "order_values",
    "orders_from_kafka",
    "build",
    "build_order_stream",
    "build_kafka_order_stream",
    "expected_totals",
    "final_totals",
    "verify_totals",
    "add_arguments",
    "run",
    "main",
]

PRODUCTS = ("book", "laptop", "phone", "headphones", "desk", "chair", "lamp", "monitor")
REGIONS = ("EU", "NA", "APAC", "LATAM")

_CUSTOMER_STRIDE = np.uint64(7919)  # a prime: spreads consecutive orders over customers
_KNUTH = np.uint64(2654435761)  # Knuth's multiplicative hash constant
_LOW32 = np.uint64(0xFFFFFFFF)
_MIN_CENTS = 100  # $1.00
_CENTS_SPAN = 49_900  # amounts are $1.00 .. $499.99
_CHUNK = 1 << 20  # orders per step of the direct computation (bounded memory)


def order_columns(values: np.ndarray, customers: int) -> dict[str, np.ndarray]:
    """The order columns derived from sequence numbers ``values`` (pure, vectorized).

    Unsigned 64-bit arithmetic wraps identically everywhere, so the same
    sequence number always gives the same order.
    """
    v = values.astype(np.uint64, copy=False)
    mixed = (v * _KNUTH) & _LOW32
    return {
        "order_id": values.astype(np.int64, copy=False),
        "customer_id": ((v * _CUSTOMER_STRIDE) % np.uint64(customers)).astype(np.int64),
        "product": ((mixed >> np.uint64(16)) % np.uint64(len(PRODUCTS))).astype(np.int64),
        "amount_cents": (np.uint64(_MIN_CENTS) + mixed % np.uint64(_CENTS_SPAN)).astype(np.int64),
    }


_PRODUCT_NAMES = pa.array(PRODUCTS, type=pa.string())


def generate_orders(batch: pa.RecordBatch, customers: int) -> pa.RecordBatch:
    """``map_batches`` step: a batch of sequence numbers -> a batch of orders."""
    cols = order_columns(batch.column("value").to_numpy(), customers)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(cols["order_id"]),
            pa.array(cols["customer_id"]),
            _PRODUCT_NAMES.take(pa.array(cols["product"])),
            pa.array(cols["amount_cents"]),
        ],
        names=["order_id", "customer_id", "product", "amount_cents"],
    )


def enrich(order: dict[str, Any]) -> dict[str, Any]:
    """``map`` step, one record at a time: add the customer's region and the amount in USD."""
    order["region"] = REGIONS[order["customer_id"] % len(REGIONS)]
    order["amount_usd"] = order["amount_cents"] / 100
    return order


def start_running_total(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``map_batches`` step: every order opens its customer's running total with its own
    amount (``add_running_total`` adds the earlier ones; a key's first record passes
    ``reduce`` as it is)."""
    return batch.append_column("customer_total_cents", batch.column("amount_cents"))


def add_running_total(total: dict[str, Any], order: dict[str, Any]) -> dict[str, Any]:
    """``reduce`` step, one record at a time: ``order`` with its customer's running total
    (every earlier order of the customer plus this one)."""
    order["customer_total_cents"] = total["customer_total_cents"] + order["amount_cents"]
    return order


#: The columns of ``build_order_stream``'s records, in order.
ORDER_STREAM_COLUMNS = (
    "order_id",
    "customer_id",
    "product",
    "amount_cents",
    "customer_total_cents",
    "region",
    "amount_usd",
)


def build_order_stream(
    env: StreamExecutionEnvironment,
    orders: int,
    customers: int,
    parallelism: int,
    batch_size: int | None = None,
    records_per_second: float | None = None,
) -> DataStream:
    """The orders pipeline with one record per order (``ORDER_STREAM_COLUMNS``): each
    enriched order with its customer's running total. Add a sink with ``sink_to``.

    ``batch_size`` and ``records_per_second`` go to each source subtask (see
    ``NumberSequenceSource``). The keyed step is named ``RunningTotal``.
    """
    if orders < 1:
        raise ValueError(f"orders must be >= 1, got {orders}")
    if customers < 1:
        raise ValueError(f"customers must be >= 1, got {customers}")
    env.set_parallelism(parallelism)
    source = NumberSequenceSource(
        0, orders - 1, batch_size=batch_size, records_per_second=records_per_second
    )
    generated = (
        env.from_source(source, "Orders")
        .uid("orders")
        .map_batches(functools.partial(generate_orders, customers=customers), "GenerateOrders")
    )
    return _running_totals(generated)


def _running_totals(orders: DataStream) -> DataStream:
    return (
        orders.map_batches(start_running_total, "OpeningTotal")
        .map(enrich, "Enrich")
        .key_by("customer_id")
        .reduce(add_running_total, "RunningTotal")
        .uid("running-total")
    )


#: An order as the orders topic holds it (a JSON object per record).
ORDER_JSON_TYPE = pa.struct(
    [
        ("order_id", pa.int64()),
        ("customer_id", pa.int64()),
        ("product", pa.string()),
        ("amount_cents", pa.int64()),
    ]
)


def order_values(first: int, end: int, customers: int) -> tuple[list[bytes], list[bytes]]:
    """``(keys, values)`` of orders ``first .. end-1`` for an orders topic: the customer id
    as the key, the order as a JSON object (the same orders ``generate_orders`` makes)."""
    cols = order_columns(np.arange(first, end, dtype=np.int64), customers)
    keys, values = [], []
    for oid, cid, product, cents in zip(
        cols["order_id"].tolist(),
        cols["customer_id"].tolist(),
        cols["product"].tolist(),
        cols["amount_cents"].tolist(),
    ):
        keys.append(str(cid).encode())
        values.append(
            f'{{"order_id":{oid},"customer_id":{cid},"product":"{PRODUCTS[product]}",'
            f'"amount_cents":{cents}}}'.encode()
        )
    return keys, values


def orders_from_kafka(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``map_batches`` step: Kafka records whose ``value`` is an order (``ORDER_JSON_TYPE``)
    -> a batch of orders, the columns of ``generate_orders``."""
    value = batch.column("value")
    if value.null_count:
        raise ValueError(f"{value.null_count} records of the orders topic have no value")
    return pa.RecordBatch.from_arrays(
        [value.field(name) for name in ORDER_JSON_TYPE.names], names=ORDER_JSON_TYPE.names
    )


def build_kafka_order_stream(
    env: StreamExecutionEnvironment, source: Source, parallelism: int
) -> DataStream:
    """``build_order_stream`` on orders read from Kafka: ``source`` is a ``KafkaSource``
    whose values are JSON orders (``set_value_format("json", ORDER_JSON_TYPE)``)."""
    env.set_parallelism(parallelism)
    orders = (
        env.from_source(source, "Orders")
        .uid("orders")
        .map_batches(orders_from_kafka, "ParseOrders")
    )
    return _running_totals(orders)


def build(
    env: StreamExecutionEnvironment, orders: int, customers: int, parallelism: int
) -> CollectSink:
    """Define the orders pipeline on ``env``; returns the sink that will hold the totals.

    After ``env.execute()``, ``result.sink_result(sink)`` is a table of
    ``(customer_id, amount_cents)`` rows: each customer's running total, one
    row per input batch that touched the customer, in order.
    """
    if orders < 1:
        raise ValueError(f"orders must be >= 1, got {orders}")
    if customers < 1:
        raise ValueError(f"customers must be >= 1, got {customers}")
    env.set_parallelism(parallelism)
    sink = CollectSink()
    (
        env.from_source(NumberSequenceSource(0, orders - 1), "Orders")
        .map_batches(functools.partial(generate_orders, customers=customers), "GenerateOrders")
        .map(enrich, "Enrich")
        .key_by("customer_id")
        .sum("amount_cents", "TotalPerCustomer")
        .sink_to(sink, "Totals")
    )
    return sink


def expected_totals(orders: int, customers: int) -> tuple[np.ndarray, np.ndarray]:
    """``(customer_ids, totals)``, sorted by id, computed directly from the same formulas.

    Only customers with at least one order appear (as in the job's output).
    """
    counts = np.zeros(customers, dtype=np.int64)
    totals = np.zeros(customers, dtype=np.int64)
    for lo in range(0, orders, _CHUNK):
        cols = order_columns(np.arange(lo, min(orders, lo + _CHUNK), dtype=np.int64), customers)
        counts += np.bincount(cols["customer_id"], minlength=customers)
        # float64 sums of one chunk stay far below 2**53, so they are exact
        part = np.bincount(cols["customer_id"], weights=cols["amount_cents"], minlength=customers)
        totals += part.astype(np.int64)
    ids = np.nonzero(counts)[0]
    return ids, totals[ids]


def final_totals(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """``(customer_ids, totals)``, sorted by id: the last running total emitted per customer."""
    if table.num_rows == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    keys = table.column("customer_id").to_numpy()[::-1]
    values = table.column("amount_cents").to_numpy()[::-1]
    ids, first_in_reverse = np.unique(keys, return_index=True)
    return ids, values[first_in_reverse]


@dataclass
class Verification:
    ok: bool
    customers: int
    revenue_cents: int
    problem: str = ""


def verify_totals(table: pa.Table, orders: int, customers: int) -> Verification:
    """Compare the job's final totals per customer with the direct computation."""
    ids, totals = final_totals(table)
    expected_ids, expected = expected_totals(orders, customers)
    revenue = int(expected.sum())
    if not np.array_equal(ids, expected_ids):
        missing = np.setdiff1d(expected_ids, ids)
        extra = np.setdiff1d(ids, expected_ids)
        return Verification(
            False,
            len(ids),
            revenue,
            f"customers differ: {len(missing)} missing (e.g. {missing[:5].tolist()}), "
            f"{len(extra)} unexpected (e.g. {extra[:5].tolist()})",
        )
    wrong = np.nonzero(totals != expected)[0]
    if len(wrong):
        examples = ", ".join(
            f"customer {ids[i]}: got {totals[i]}, expected {expected[i]}" for i in wrong[:3]
        )
        return Verification(
            False, len(ids), revenue, f"{len(wrong)} of {len(ids)} totals wrong ({examples})"
        )
    return Verification(True, len(ids), revenue)


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The totals job's options."""
    parser.add_argument(
        "--orders",
        type=_positive_int,
        default=200_000,
        metavar="N",
        help="number of synthetic orders (default: %(default)s)",
    )
    parser.add_argument(
        "--customers",
        type=_positive_int,
        default=1_000,
        metavar="N",
        help="number of distinct customers (default: %(default)s)",
    )
    parser.add_argument(
        "--parallelism",
        type=_positive_int,
        default=2,
        metavar="P",
        help="parallel subtasks per operator (default: %(default)s)",
    )
    parser.add_argument(
        "--checkpoint-ms",
        type=checkpoint_interval_ms(allow_off=True),
        default=500,
        metavar="MS",
        help="EXACTLY_ONCE checkpoint interval, 0 for checkpointing off (default: %(default)s)",
    )
    parser.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="Ray cluster to join (default: $RAY_ADDRESS, else start a local Ray)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the job as ``args`` say, print a summary; 0 when the totals check out, else 1."""
    ensure_ray(args.address)
    env = StreamExecutionEnvironment.get_execution_environment()
    if args.checkpoint_ms:
        env.enable_checkpointing(args.checkpoint_ms)
    sink = build(env, args.orders, args.customers, args.parallelism)
    wall_start = time.perf_counter()
    result = env.execute("orders")
    wall = time.perf_counter() - wall_start
    table = result.sink_result(sink)
    check = verify_totals(table, args.orders, args.customers)
    seconds = result.duration_s if result.duration_s > 0 else wall
    print(f"rayflow orders job (parallelism {args.parallelism})")
    print(f"  records:     {args.orders:,} orders -> {table.num_rows:,} running-total updates")
    print(f"  customers:   {check.customers:,}")
    print(f"  revenue:     ${check.revenue_cents / 100:,.2f}")
    print(f"  time:        {seconds:.2f} s (job, including subtask start-up; {wall:.2f} s wall)")
    print(f"  throughput:  {args.orders / seconds:,.0f} records/s")
    print(f"  checkpoints: {len(result.completed_checkpoints)} completed")
    for name, words in result.guarantees.items():
        print(f"  guarantee:   {name}: {words}")
    if check.ok:
        print("  totals verified: OK")
        return 0
    print(f"  totals verified: MISMATCH: {check.problem}")
    print(
        f"orders job: totals do not match the direct computation: {check.problem}", file=sys.stderr
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="orders",
            description="Synthetic orders -> per-record enrich -> running total per customer, "
            "verified against a direct computation.",
        )
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
