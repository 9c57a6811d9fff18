"""Stable key hashing and the key -> key group -> subtask mapping.

Python's ``hash()`` of ``str`` is salted per process, so it can never decide
where a key lives. Every subtask, driver and restored job must agree on the key
group of a key, so the hash here is a pure function of the key's value:
integers go through the splitmix64 finalizer (vectorized with numpy for whole
columns), everything else through CRC32 of a canonical byte encoding.

A key group is the unit of keyed state: ``key_group = hash(key) % max_parallelism``
and ``subtask = key_group * parallelism // max_parallelism`` (Flink's ranges),
so a checkpoint taken at one parallelism restores at another.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DEFAULT_MAX_PARALLELISM = 128

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _splitmix64_array(values: np.ndarray) -> np.ndarray:
    """splitmix64 of every element, in two arrays of the column's length (in place)."""
    z = values.astype(np.uint64, copy=True)
    shifted = np.empty_like(z)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        np.right_shift(z, np.uint64(30), out=shifted)
        z ^= shifted
        z *= np.uint64(0xBF58476D1CE4E5B9)
        np.right_shift(z, np.uint64(27), out=shifted)
        z ^= shifted
        z *= np.uint64(0x94D049BB133111EB)
        np.right_shift(z, np.uint64(31), out=shifted)
        z ^= shifted
    return z


def _canonical_bytes(key: Any) -> bytes:
    if isinstance(key, str):
        return b"s" + key.encode("utf-8")
    if isinstance(key, bytes):
        return b"b" + key
    if isinstance(key, float):
        if key.is_integer():
            return _canonical_bytes(int(key))
        return b"f" + repr(key).encode()
    if isinstance(key, tuple):
        return b"t" + b"\x00".join(_canonical_bytes(part) for part in key)
    if key is None:
        return b"n"
    return b"r" + repr(key).encode("utf-8")


def stable_hash(key: Hashable) -> int:
    """A 64-bit hash of ``key`` that is the same in every process and run."""
    if isinstance(key, bool):
        key = int(key)
    if isinstance(key, (int, np.integer)):
        return _splitmix64(int(key) & _MASK64)
    if isinstance(key, float) and key.is_integer():
        return _splitmix64(int(key) & _MASK64)
    return zlib.crc32(_canonical_bytes(key))


def key_group_of(key: Hashable, max_parallelism: int) -> int:
    """The key group that owns ``key``."""
    return stable_hash(key) % max_parallelism


def key_groups_of_array(keys: pa.Array | pa.ChunkedArray, max_parallelism: int) -> np.ndarray:
    """Key groups of a whole key column, equal element-wise to :func:`key_group_of`."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if pa.types.is_integer(keys.type) and keys.null_count == 0:
        hashed = _splitmix64_array(keys.to_numpy(zero_copy_only=False).astype(np.int64))
        if max_parallelism & (max_parallelism - 1) == 0:  # a power of two: the low bits
            hashed &= np.uint64(max_parallelism - 1)
        else:
            hashed %= np.uint64(max_parallelism)
        return hashed.astype(np.int64)
    encoded = pc.dictionary_encode(keys)
    uniques = encoded.dictionary.to_pylist()
    groups = np.fromiter(
        (key_group_of(k, max_parallelism) for k in uniques), dtype=np.int64, count=len(uniques)
    )
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    if keys.null_count:
        none_group = key_group_of(None, max_parallelism)
        valid = encoded.indices.is_valid().to_numpy(zero_copy_only=False)
        out = np.full(len(keys), none_group, dtype=np.int64)
        out[valid] = groups[indices[valid].astype(np.int64)]
        return out
    return groups[indices.astype(np.int64)]


def subtask_of_key_group(key_group: int, parallelism: int, max_parallelism: int) -> int:
    """The subtask index that owns ``key_group`` at ``parallelism``."""
    return key_group * parallelism // max_parallelism


def key_groups_of_subtask(index: int, parallelism: int, max_parallelism: int) -> range:
    """The contiguous range of key groups owned by subtask ``index``."""
    start = (index * max_parallelism + parallelism - 1) // parallelism
    end = ((index + 1) * max_parallelism + parallelism - 1) // parallelism
    return range(start, end)
