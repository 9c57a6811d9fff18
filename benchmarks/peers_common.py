"""What the peer benchmark's driver and its engine runners share: the expected result of
the keyed running sum, its check, and the one-line result format.

Standard library only: the runners import it inside the peer engines' own virtual
environments (``benchmarks/peers_bytewax.py``, ``benchmarks/peers_pyflink.py``), where
rayflow is not installed. See ``benchmarks/peers.py`` for the workload.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = [
    "KEYS",
    "RESULT_PREFIX",
    "MODES",
    "expected_sum",
    "check_sums",
    "merge_max",
    "emit",
    "parse_result",
    "load_average",
]

#: Distinct keys: record ``i`` has key ``i % KEYS`` and value ``i``.
KEYS = 1000
#: A runner's result is the one stdout line starting with this (engines print their own).
RESULT_PREFIX = "PEERS-RESULT "
#: Checkpointing modes, as every runner spells them on its command line.
MODES = ("none", "at-least-once", "exactly-once", "unaligned")


def expected_sum(records: int, key: int) -> int:
    """Sum of every ``i`` in ``0..records-1`` with ``i % KEYS == key``."""
    if key >= records:
        return 0
    count = (records - 1 - key) // KEYS + 1
    return count * key + KEYS * count * (count - 1) // 2


def check_sums(records: int, sums: Mapping[int, int], count: int | None = None) -> str:
    """``"ok"`` when ``sums`` holds the exact final sum of every key (and ``count``, when
    given, is ``records``: one update per input record); otherwise ``"WRONG: ..."``
    saying what is off."""
    problems = []
    keys = min(KEYS, records)
    missing = [k for k in range(keys) if k not in sums]
    if missing:
        problems.append(f"{len(missing)} of {keys} keys missing (first {missing[0]})")
    extra = sorted(k for k in sums if not 0 <= k < keys)
    if extra:
        problems.append(f"{len(extra)} unexpected keys (first {extra[0]})")
    wrong = [k for k in range(keys) if k in sums and sums[k] != expected_sum(records, k)]
    if wrong:
        k = wrong[0]
        problems.append(
            f"{len(wrong)} sums wrong (key {k}: {sums[k]}, expected {expected_sum(records, k)})"
        )
    if count is not None and count != records:
        problems.append(f"{count} updates, expected {records}")
    return "ok" if not problems else "WRONG: " + "; ".join(problems)


def merge_max(parts: list[Mapping[Any, int]]) -> dict[int, int]:
    """The largest sum per key over several sink partitions (keys as ints)."""
    merged: dict[int, int] = {}
    for part in parts:
        for key, value in part.items():
            k = int(key)
            if k not in merged or value > merged[k]:
                merged[k] = value
    return merged


def emit(result: Mapping[str, Any]) -> None:
    """Print ``result`` as the runner's one result line."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(dict(result), sort_keys=True) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The last result line in a runner's ``stdout``, or None when there is none."""
    found = None
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            found = json.loads(line[len(RESULT_PREFIX) :])
    return found


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return None
