"""How to move pyarrow RecordBatches between Ray actors fastest: a transport comparison.

A bare chain of three async Ray actors, source -> relay -> sink, moves RecordBatches of
int64 columns. Every hop keeps up to 16 ``.remote()`` calls in flight and awaits the
oldest when 16 are outstanding, as rayflow's ``OutputChannel`` does. The relay decodes
every message into RecordBatches and encodes them again for the next hop (as an
operator between two channels would); the sink decodes and counts rows.

Receiving side: by default the actors' ``push`` does nothing but the above (no
``InputGate``), so the rows measure transport alone. Variants marked ``+gate`` put every
message through rayflow's real :class:`~rayflow.runtime.channels.InputGate` (``push``
admits it in sequence order, a reader task takes it with ``next()`` and forwards it),
so the gate's cost can be read against the same transport without it.

What is varied (the report names each variant as below):

* **encoding** -- ``pickle``: the RecordBatch itself, pickled by Ray (pickle 5, its
  buffers out of band); ``ipc``: Arrow IPC: a tuple ``(schema message, record batch
  message)`` of ``pa.Buffer`` (``schema.serialize()``, ``batch.serialize()``), decoded
  with ``pa.ipc.read_record_batch`` (zero-copy over the received buffer);
  ``ipcstream``: one whole IPC stream (schema, batches, end) per message.
* **batches per call** -- ``xK``: K batches in one call (``pickle``: a list of
  RecordBatches; ``ipc``: the schema message and a list of K batch messages;
  ``ipcstream``: one stream of K batches); ``concatK``: K batches joined with
  ``pa.concat_batches`` by the source into one bigger batch. 10 kB batches are also
  coalesced 96 to a call (960 kB, just under 1 MiB) under every inline limit.
* **put** -- the sender ``ray.put``s the payload and passes the ObjectRef as the
  call's argument (Ray resolves it before ``push`` runs).
* **Ray's inline limit** -- ``max_direct_call_object_size`` (arguments up to this size
  travel inside the call; bigger ones through the shared-memory object store), set by
  ``_system_config`` of a new local Ray: each setting runs in a subprocess of its own
  that starts its own ``ray.init(address="local", _system_config=...)``.

Batch sizes are in bytes of column data (``--columns`` int64 columns, so 10 kB is
1,250 rows of one column). Each cell moves about the same number of bytes.

Rates: ``rows/s`` = rows / time of the source's ``run`` call, the actors already up and
warm (every variant runs once, small, before anything is timed).

Also measured (``micro``): per-call costs without Ray -- pickling a RecordBatch vs IPC
encode and decode, Ray's own serializer on each payload (and the payload's serialized
size, which decides inline vs object store; also for a sliced batch, which pickles with
its parent's whole buffers), ``pa.concat_batches``, the ``InputGate``'s
push + next per message in plain asyncio -- and the call rate of the bare chain with an
empty payload (Ray's per-call floor).

Every timed child holds ``/tmp/bench.lock`` (``flock``) for itself only, so others'
benchmarks can run between them; rounds interleave every variant and Ray setting, and the
report gives the median over rounds. Run from the repository root::

    python benchmarks/transport.py [--rounds 3] [--quick]

Benchmarks are never timed assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections import deque
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IN_FLIGHT = 16
LOCK = "/tmp/bench.lock"

#: batch sizes, in bytes of column data
SIZES = {"10kB": 10_000, "100kB": 100_000, "1MB": 1_000_000}
#: bytes of column data moved per timed run, per batch size
VOLUME = {"10kB": 16_000_000, "100kB": 200_000_000, "1MB": 600_000_000}

#: Ray settings of ``max_direct_call_object_size`` (None: Ray's default, 100 KiB)
RAY_SETTINGS: dict[str, int | None] = {
    "default": None,
    "512KiB": 512 * 1024,
    "1MiB": 1024 * 1024,
    "4MiB": 4 * 1024 * 1024,
}


class Encoding(Enum):
    PICKLE = "pickle"
    IPC = "ipc"
    IPC_STREAM = "ipcstream"


@dataclass(frozen=True)
class Variant:
    encoding: Encoding
    per_call: int = 1
    concat: bool = False  # join the per_call batches into one (else a list)
    put: bool = False
    gate: bool = False

    @property
    def name(self) -> str:
        name = self.encoding.value
        if self.per_call > 1:
            name += f"-concat{self.per_call}" if self.concat else f"-x{self.per_call}"
        if self.put:
            name += "-put"
        if self.gate:
            name += "+gate"
        return name

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["encoding"] = self.encoding.value
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> Variant:
        return Variant(**{**d, "encoding": Encoding(d["encoding"])})


P, IPC, S = Encoding.PICKLE, Encoding.IPC, Encoding.IPC_STREAM

#: under Ray's default setting, at every batch size
DEFAULT_VARIANTS = [
    Variant(P),
    Variant(IPC),
    Variant(S),
    Variant(P, 2),
    Variant(P, 4),
    Variant(P, 8),
    Variant(IPC, 4),
    Variant(IPC, 8),
    Variant(P, 4, concat=True),
    Variant(P, 8, concat=True),
    Variant(P, put=True),
    Variant(IPC, put=True),
    Variant(P, gate=True),
    Variant(IPC, gate=True),
    Variant(P, 8, gate=True),
]
#: under the raised inline limits: the batch sizes and variants the limit can change
RAISED_SIZES = ("100kB", "1MB")
RAISED_VARIANTS = [
    Variant(P),
    Variant(IPC),
    Variant(P, 2),
    Variant(P, 4),
    Variant(P, 8),
    Variant(IPC, 8),
    Variant(P, 8, concat=True),
]
#: 10 kB batches coalesced to 960 kB per call (just under 1 MiB), under every setting
COALESCE = 96
COALESCED_VARIANTS = [
    Variant(P, COALESCE),
    Variant(IPC, COALESCE),
    Variant(S, COALESCE),
    Variant(P, COALESCE, concat=True),
]


# --- payloads ------------------------------------------------------------------------------


def make_batch(lo: int, rows: int, columns: int) -> pa.RecordBatch:
    arrays = [pa.array(np.arange(lo, lo + rows, dtype=np.int64) * (c + 1)) for c in range(columns)]
    return pa.RecordBatch.from_arrays(arrays, names=[f"c{c}" for c in range(columns)])


_schemas: dict[bytes, pa.Schema] = {}


def _schema_of(message: pa.Buffer) -> pa.Schema:
    key = message.to_pybytes()
    schema = _schemas.get(key)
    if schema is None:
        schema = _schemas[key] = pa.ipc.read_schema(message)
    return schema


def encode(batches: list[pa.RecordBatch], encoding: Encoding) -> Any:
    """One message's payload for ``batches`` (one batch travels bare, more as a list)."""
    if encoding is Encoding.PICKLE:
        return batches[0] if len(batches) == 1 else batches
    if encoding is Encoding.IPC:
        schema = batches[0].schema.serialize()
        if len(batches) == 1:
            return (schema, batches[0].serialize())
        return (schema, [b.serialize() for b in batches])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue()


def decode(payload: Any, encoding: Encoding) -> list[pa.RecordBatch]:
    if encoding is Encoding.PICKLE:
        return payload if isinstance(payload, list) else [payload]
    if encoding is Encoding.IPC:
        schema_message, body = payload
        schema = _schema_of(schema_message)
        if isinstance(body, list):
            return [pa.ipc.read_record_batch(b, schema) for b in body]
        return [pa.ipc.read_record_batch(body, schema)]
    return list(pa.ipc.open_stream(payload))


# --- the chain -----------------------------------------------------------------------------


def _actors() -> tuple[Any, Any, Any]:
    import ray

    @ray.remote
    class Hop:
        """Relay (``downstream`` set) or sink (``downstream`` None)."""

        def __init__(self, downstream: Any) -> None:
            self.downstream = downstream
            self.variant: Variant | None = None
            self.in_flight: deque = deque()
            self.rows = 0
            self.calls = 0
            self.gate: Any = None
            self.reader: asyncio.Task | None = None
            self.received = 0
            self.handled = 0
            self.seq = 0

        async def configure(self, variant: dict[str, Any]) -> None:
            self.variant = Variant.from_json(variant)
            self.rows = self.calls = self.received = self.handled = self.seq = 0
            if self.reader is not None:
                self.reader.cancel()
                self.reader = None
            self.gate = None
            if self.variant.gate:
                from rayflow.runtime.channels import InputGate

                self.gate = InputGate(1, 8)  # rayflow's default buffer of 8 per channel
                self.reader = asyncio.get_running_loop().create_task(self._read())
            if self.downstream is not None:
                await self.downstream.configure.remote(variant)

        async def _handle(self, payload: Any) -> None:
            v = self.variant
            batches = decode(payload, v.encoding)
            self.calls += 1
            if self.downstream is None:
                self.rows += sum(b.num_rows for b in batches)
                return
            out = encode(batches, v.encoding)
            if v.put:
                import ray

                out = ray.put(out)
            while len(self.in_flight) >= IN_FLIGHT:
                await self.in_flight.popleft()
            if self.gate is not None:
                self.in_flight.append(self.downstream.push.remote(out, self.seq))
                self.seq += 1
            else:
                self.in_flight.append(self.downstream.push.remote(out))

        async def _read(self) -> None:
            while True:
                _, payload = await self.gate.next()
                await self._handle(payload)
                self.handled += 1

        async def push(self, payload: Any, seq: int = -1) -> None:
            if self.gate is None:
                await self._handle(payload)
            else:
                self.received += 1
                await self.gate.push(0, seq, payload)

        async def flush(self) -> None:
            while self.handled < self.received:
                await asyncio.sleep(0.0005)
            while self.in_flight:
                await self.in_flight.popleft()
            if self.downstream is not None:
                await self.downstream.flush.remote()

        async def take(self) -> dict[str, int]:
            return {"rows": self.rows, "calls": self.calls}

    @ray.remote
    class Source:
        def __init__(self, downstream: Any) -> None:
            self.downstream = downstream

        async def run(
            self, variant: dict[str, Any], rows: int, batch_rows: int, columns: int
        ) -> None:
            import ray

            v = Variant.from_json(variant)
            in_flight: deque = deque()
            seq = 0
            lo = 0
            while lo < rows:
                batches = []
                for _ in range(v.per_call):
                    if lo >= rows:
                        break
                    n = min(batch_rows, rows - lo)
                    batches.append(make_batch(lo, n, columns))
                    lo += n
                if v.concat and len(batches) > 1:
                    batches = [pa.concat_batches(batches)]
                payload = encode(batches, v.encoding)
                if v.put:
                    payload = ray.put(payload)
                while len(in_flight) >= IN_FLIGHT:
                    await in_flight.popleft()
                if v.gate:
                    in_flight.append(self.downstream.push.remote(payload, seq))
                else:
                    in_flight.append(self.downstream.push.remote(payload))
                seq += 1
                await asyncio.sleep(0)
            while in_flight:
                await in_flight.popleft()
            await self.downstream.flush.remote()

        async def empty_calls(self, calls: int) -> None:
            in_flight: deque = deque()
            for _ in range(calls):
                while len(in_flight) >= IN_FLIGHT:
                    await in_flight.popleft()
                in_flight.append(self.downstream.push_empty.remote())
            while in_flight:
                await in_flight.popleft()
            await self.downstream.flush_empty.remote()

    @ray.remote
    class EmptyHop:
        def __init__(self, downstream: Any) -> None:
            self.downstream = downstream
            self.in_flight: deque = deque()

        async def push_empty(self) -> None:
            if self.downstream is not None:
                while len(self.in_flight) >= IN_FLIGHT:
                    await self.in_flight.popleft()
                self.in_flight.append(self.downstream.push_empty.remote())

        async def flush_empty(self) -> None:
            while self.in_flight:
                await self.in_flight.popleft()
            if self.downstream is not None:
                await self.downstream.flush_empty.remote()

    return Hop, Source, EmptyHop


def _cells(setting: str) -> list[tuple[str, Variant]]:
    sizes = list(SIZES) if setting == "default" else list(RAISED_SIZES)
    variants = DEFAULT_VARIANTS if setting == "default" else RAISED_VARIANTS
    # an object-store round trip per 10 kB batch only shows what is already clear at 100 kB
    cells = [(size, v) for size in sizes for v in variants if not (v.put and size == "10kB")]
    return [("10kB", v) for v in COALESCED_VARIANTS] + cells


def run_chain(setting: str, round_no: int, columns: int, quick: bool) -> list[dict[str, Any]]:
    """One round of every cell of ``setting`` in a new local Ray (this process's)."""
    import ray

    system_config = {}
    if RAY_SETTINGS[setting] is not None:
        system_config["max_direct_call_object_size"] = RAY_SETTINGS[setting]
    ray.init(
        address="local",
        include_dashboard=False,
        logging_level="WARNING",
        _system_config=system_config or None,
    )
    Hop, Source, _ = _actors()
    sink = Hop.remote(None)
    relay = Hop.remote(sink)
    source = Source.remote(relay)
    ray.get([sink.take.remote(), relay.take.remote(), source.__ray_ready__.remote()])

    cells = _cells(setting)
    shift = round_no % len(cells)  # a different order each round
    cells = cells[shift:] + cells[:shift]

    def once(size: str, v: Variant, volume: int) -> dict[str, Any]:
        batch_rows = SIZES[size] // (8 * columns)
        rows = max(batch_rows * v.per_call * IN_FLIGHT * 2, volume // (8 * columns))
        ray.get(relay.configure.remote(v.to_json()))
        started = time.perf_counter()
        ray.get(source.run.remote(v.to_json(), rows, batch_rows, columns))
        elapsed = time.perf_counter() - started
        got = ray.get(sink.take.remote())
        if got["rows"] != rows:
            raise RuntimeError(f"{v.name} {size}: {got['rows']} rows arrived, expected {rows}")
        return {
            "setting": setting,
            "size": size,
            "variant": v.name,
            "round": round_no,
            "rows": rows,
            "calls": got["calls"],
            "seconds": elapsed,
            "rows_per_s": rows / elapsed,
            "mb_per_s": rows * 8 * columns / elapsed / 1e6,
        }

    for size, v in cells:  # warm-up: every path once, small
        once(size, v, 0)
    results = []
    for size, v in cells:
        volume = max(VOLUME[size], SIZES[size] * v.per_call * 100) // (8 if quick else 1)
        r = once(size, v, volume)
        print(
            f"  [{setting} r{round_no}] {size:>5} {v.name:<18} {r['rows_per_s']:>14,.0f} rows/s "
            f"{r['mb_per_s']:>7.0f} MB/s  {r['calls'] / r['seconds']:>6.0f} calls/s",
            flush=True,
        )
        results.append(r)
    for actor in (source, relay, sink):
        ray.kill(actor)
    ray.shutdown()
    return results


# --- per-call costs ------------------------------------------------------------------------


def _us(fn: Any, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def _gate_us(messages: int) -> float:
    """rayflow's InputGate: one pusher, one reader, per message (plain asyncio)."""
    from rayflow.runtime.channels import InputGate

    async def go() -> float:
        gate = InputGate(1, 8)

        async def pusher() -> None:
            for seq in range(messages):
                await gate.push(0, seq, seq)

        task = asyncio.get_running_loop().create_task(pusher())
        started = time.perf_counter()
        for _ in range(messages):
            await gate.next()
        elapsed = time.perf_counter() - started
        await task
        return elapsed / messages * 1e6

    return min(asyncio.run(go()) for _ in range(3))


def _costs(ctx: Any, nbytes: int, columns: int) -> tuple[dict[str, float], dict[str, int]]:
    """Per-call costs (us) and Ray-serialized sizes (bytes) for one batch size."""
    rows = nbytes // (8 * columns)
    batch = make_batch(0, rows, columns)
    schema = batch.schema
    message = batch.serialize()
    schema_message = schema.serialize()
    stream = encode([batch], Encoding.IPC_STREAM)
    ipc_payload = encode([batch], Encoding.IPC)
    pieces = [make_batch(i * rows, rows, columns) for i in range(8)]
    number = 2000 if nbytes < 1_000_000 else 500
    buffers: list[Any] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    costs = {
        "pickle.dumps (pickle 5, buffers out of band)": _us(
            lambda: pickle.dumps(batch, protocol=5, buffer_callback=[].append), number
        ),
        "pickle.loads (buffers out of band)": _us(
            lambda: pickle.loads(data, buffers=buffers), number
        ),
        "pickle.dumps, buffers in band": _us(lambda: pickle.dumps(batch, protocol=5), number),
        "Ray serializer: RecordBatch": _us(lambda: ctx.serialize(batch), number),
        "ipc encode: schema.serialize() + batch.serialize()": _us(
            lambda: (schema.serialize(), batch.serialize()), number
        ),
        "ipc decode: read_record_batch (schema known)": _us(
            lambda: pa.ipc.read_record_batch(message, schema), number
        ),
        "ipc decode: read_schema + read_record_batch": _us(
            lambda: pa.ipc.read_record_batch(message, pa.ipc.read_schema(schema_message)), number
        ),
        "ipc decode: cached schema lookup + read_record_batch": _us(
            lambda: decode(ipc_payload, Encoding.IPC), number
        ),
        "Ray serializer: (schema, message) tuple of pa.Buffer": _us(
            lambda: ctx.serialize(ipc_payload), number
        ),
        "ipc stream encode (new_stream, 1 batch)": _us(
            lambda: encode([batch], Encoding.IPC_STREAM), number
        ),
        "ipc stream decode (open_stream, 1 batch)": _us(
            lambda: decode(stream, Encoding.IPC_STREAM), number
        ),
        "Ray serializer: list of 8 RecordBatches": _us(lambda: ctx.serialize(pieces), number),
        "pa.concat_batches of 8": _us(lambda: pa.concat_batches(pieces), max(1, number // 4)),
    }
    sizes = {
        "rows": rows,
        "Ray serialized bytes: RecordBatch": ctx.serialize(batch).total_bytes,
        "Ray serialized bytes: ipc tuple": ctx.serialize(ipc_payload).total_bytes,
        "Ray serialized bytes: list of 8": ctx.serialize(pieces).total_bytes,
    }
    # A slice pickles with its parent's whole buffers; IPC writes only the sliced range.
    piece = make_batch(0, rows * 10, columns).slice(rows, rows)
    sizes["Ray serialized bytes: RecordBatch sliced from one 10x bigger"] = ctx.serialize(
        piece
    ).total_bytes
    sizes["Ray serialized bytes: ipc tuple of that slice"] = ctx.serialize(
        encode([piece], Encoding.IPC)
    ).total_bytes
    return costs, sizes


def micro(columns: int) -> dict[str, Any]:
    import ray

    ray.init(address="local", include_dashboard=False, logging_level="WARNING")
    ctx = ray._private.worker.global_worker.get_serialization_context()
    out: dict[str, Any] = {"costs": [], "sizes": {}}
    for size, nbytes in SIZES.items():
        costs, sizes = _costs(ctx, nbytes, columns)
        for name, us in costs.items():
            out["costs"].append({"size": size, "what": name, "us": us})
        out["sizes"][size] = sizes
    out["gate_us"] = _gate_us(20_000)

    # Ray's per-call floor: the chain with no payload at all.
    _, Source, EmptyHop = _actors()
    sink = EmptyHop.remote(None)
    relay = EmptyHop.remote(sink)
    source = Source.remote(relay)
    ray.get(source.empty_calls.remote(500))
    rates = []
    for _ in range(3):
        started = time.perf_counter()
        ray.get(source.empty_calls.remote(5000))
        rates.append(5000 / (time.perf_counter() - started))
    out["empty_calls_per_s"] = statistics.median(rates)
    ray.shutdown()
    return out


# --- orchestration -------------------------------------------------------------------------


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _child(args: list[str], locked_s: list[float]) -> Any:
    """Run this script's ``args`` in a subprocess holding the benchmark lock; its result.
    Appends the seconds the child ran (holding the lock) to ``locked_s``."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = ["flock", LOCK, sys.executable, __file__, *args, "--out", path]
    started = time.time()
    subprocess.run(cmd, check=True)
    with open(path) as f:
        out = json.load(f)
    os.unlink(path)
    locked_s.append(out["seconds"])
    print(
        f"  ({' '.join(args)}: ran {out['seconds']:.0f}s holding the lock, "
        f"{time.time() - started:.0f}s with waiting for it)",
        flush=True,
    )
    return out["data"]


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}k"


def report(
    results: list[dict[str, Any]], micro_out: dict[str, Any] | None, meta: dict[str, Any]
) -> str:
    lines = [f"command: `{meta['command']}`", f"machine: {meta['machine']}", ""]
    lines.append(
        f"{meta['rounds']} rounds, each every cell once, interleaved; median rows/s (min-max) "
        f"over rounds. {meta['columns']} int64 column(s); load average before / after: "
        f"{meta['load_before']} / {meta['load_after']}; locked runs: "
        + ", ".join(f"{s:.0f}s" for s in meta["locked_s"])
    )
    lines.append("")
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["setting"], r["size"], r["variant"]), []).append(r)
    baseline = {
        size: statistics.median(r["rows_per_s"] for r in groups[("default", size, "pickle")])
        for size in SIZES
        if ("default", size, "pickle") in groups
    }
    lines.append(
        "| inline limit | batch | variant | bytes/call | rows/s (median) | min-max | MB/s "
        "| calls/s | vs default pickle |"
    )
    lines.append("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for (setting, size, variant), rs in groups.items():
        med = statistics.median(r["rows_per_s"] for r in rs)
        lo, hi = min(r["rows_per_s"] for r in rs), max(r["rows_per_s"] for r in rs)
        calls = statistics.median(r["calls"] / r["seconds"] for r in rs)
        per_call = rs[0]["rows"] * 8 * meta["columns"] / rs[0]["calls"]
        ratio = med / baseline[size] if size in baseline else float("nan")
        lines.append(
            f"| {setting} | {size} | {variant} | {per_call / 1e3:,.0f}k | {med:,.0f} "
            f"| {_fmt_rate(lo)}-{_fmt_rate(hi)} | {med * 8 * meta['columns'] / 1e6:,.0f} "
            f"| {calls:,.0f} | {ratio:.2f} |"
        )
    if micro_out:
        lines += ["", "Per-call costs (no Ray call; best of 5, microseconds):", ""]
        lines.append("| what | " + " | ".join(SIZES) + " |")
        lines.append("|---|" + "---:|" * len(SIZES))
        by_what: dict[str, dict[str, float]] = {}
        for c in micro_out["costs"]:
            by_what.setdefault(c["what"], {})[c["size"]] = c["us"]
        for what, per in by_what.items():
            lines.append(f"| {what} | " + " | ".join(f"{per[s]:.1f}" for s in SIZES) + " |")
        for key in next(iter(micro_out["sizes"].values())):
            lines.append(
                f"| {key} | " + " | ".join(f"{micro_out['sizes'][s][key]:,}" for s in SIZES) + " |"
            )
        lines += [
            "",
            f"rayflow InputGate push + next, one channel, plain asyncio: "
            f"{micro_out['gate_us']:.1f} us per message",
            "bare 3-actor chain with an empty payload (Ray's per-call floor): "
            f"{micro_out['empty_calls_per_s']:,.0f} messages/s, "
            f"{1e6 / micro_out['empty_calls_per_s']:.0f} us per message",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="RecordBatch transports between Ray actors")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="an eighth of the bytes per cell")
    parser.add_argument("--columns", type=int, default=1, help="int64 columns per batch")
    parser.add_argument(
        "--settings",
        default=",".join(RAY_SETTINGS),
        help="Ray inline limits to run, of: " + ", ".join(RAY_SETTINGS),
    )
    parser.add_argument("--no-micro", action="store_true", help="skip the per-call costs")
    parser.add_argument("--json", help="also write every measurement here")
    # internal: one child run
    parser.add_argument("--child", choices=[*RAY_SETTINGS, "micro"], help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        started = time.perf_counter()
        if args.child == "micro":
            result: Any = micro(args.columns)
        else:
            result = run_chain(args.child, args.round, args.columns, args.quick)
        with open(args.out, "w") as f:
            json.dump({"seconds": time.perf_counter() - started, "data": result}, f)
        return 0

    import ray

    settings = [s for s in args.settings.split(",") if s]
    command = "python " + shlex.join(
        sys.argv if argv is None else ["benchmarks/transport.py", *argv]
    )
    machine = (
        f"{os.cpu_count()} CPUs, Ray {ray.__version__}, pyarrow {pa.__version__}, "
        f"Python {sys.version.split()[0]}"
    )
    print(f"command: {command}\nmachine: {machine}\nload average: {_load()}", flush=True)
    meta: dict[str, Any] = {
        "command": command,
        "machine": machine,
        "rounds": args.rounds,
        "columns": args.columns,
        "load_before": _load(),
        "locked_s": [],
    }
    locked: list[float] = meta["locked_s"]
    common = ["--columns", str(args.columns)] + (["--quick"] if args.quick else [])
    results: list[dict[str, Any]] = []
    for round_no in range(args.rounds):
        order = settings[round_no % len(settings) :] + settings[: round_no % len(settings)]
        for setting in order:
            results += _child(["--child", setting, "--round", str(round_no), *common], locked)
    micro_out = None
    if not args.no_micro:
        micro_out = _child(["--child", "micro", *common], locked)
    meta["load_after"] = _load()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "micro": micro_out}, f, indent=1)
    print()
    print(report(results, micro_out, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
