"""Keyed state: state descriptors, the state handles user code sees, and the
heap backend that stores every value under its key group.

Keyed state lives in ``key group -> state name -> key -> value`` tables. The
key group is the unit of snapshot and restore, which is what lets a checkpoint
taken at one parallelism be restored at another (see :mod:`rayflow.keygroups`).
The backend is only ever touched from a subtask's mailbox thread.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rayflow.keygroups import key_group_of

__all__ = [
    "ValueStateDescriptor",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "ReducingStateDescriptor",
    "ValueState",
    "ListState",
    "MapState",
    "ReducingState",
]

_MISSING = object()


@dataclass(frozen=True)
class ValueStateDescriptor:
    """A single value per key; ``default`` is returned for keys never written."""

    name: str
    default: Any = None


@dataclass(frozen=True)
class ListStateDescriptor:
    """A list of values per key."""

    name: str


@dataclass(frozen=True)
class MapStateDescriptor:
    """A dictionary per key."""

    name: str


@dataclass(frozen=True)
class ReducingStateDescriptor:
    """One value per key, folded with ``reduce_function(accumulator, value)``."""

    name: str
    reduce_function: Callable[[Any, Any], Any] = field(compare=False)


class KeyedStateBackend:
    """Heap storage of keyed state, partitioned by key group.

    Looking a key's key group up (a hash) and then its tables costs more than the
    state access itself, so both are cached per key: ``key -> its key group's
    tables`` for :meth:`set_current_key`, and ``key -> table`` per state name for
    operators that touch one state per record (:meth:`key_tables`). The caches only
    ever hold references to the tables in ``key group -> state name -> key -> value``;
    they are emptied in place when a restore replaces tables, and when they grow
    past a bound. Snapshots and restores read and write the tables alone.
    """

    _KEY_CACHE_SIZE = 65_536

    def __init__(self, max_parallelism: int, key_groups: Iterable[int]) -> None:
        self.max_parallelism = max_parallelism
        self.key_groups = frozenset(key_groups)
        self._groups: dict[int, dict[str, dict[Any, Any]]] = {}
        self._current_key: Any = None
        self._current_group: dict[str, dict[Any, Any]] | None = None
        self._group_of_key: dict[Any, dict[str, dict[Any, Any]]] = {}
        self._table_of_key: dict[str, dict[Any, dict[Any, Any]]] = {}

    def _group_tables(self, key: Any) -> dict[str, dict[Any, Any]]:
        """The ``state name -> table`` of ``key``'s key group, created when missing."""
        cache = self._group_of_key
        tables = cache.get(key)
        if tables is None:
            group = key_group_of(key, self.max_parallelism)
            tables = self._groups.setdefault(group, {})
            if len(cache) >= self._KEY_CACHE_SIZE:
                cache.clear()
            cache[key] = tables
        return tables

    def set_current_key(self, key: Any) -> None:
        tables = self._group_of_key.get(key)
        if tables is None:
            tables = self._group_tables(key)
        self._current_key = key
        self._current_group = tables

    @property
    def current_key(self) -> Any:
        return self._current_key

    def table(self, name: str) -> dict[Any, Any]:
        """The ``key -> value`` table of state ``name`` in the current key group."""
        tables = self._current_group
        if tables is None:
            raise RuntimeError("keyed state used outside of a keyed context (no current key)")
        table = tables.get(name)
        if table is None:
            table = tables[name] = {}
        return table

    def key_tables(self, name: str) -> dict[Any, dict[Any, Any]]:
        """A cache ``key -> the key -> value table of state name in key's group``.

        For hot loops: a key it lacks is looked up (and added) with
        :meth:`table_of_key`. The same mapping is returned every time; it is emptied,
        never replaced, whenever an entry could go stale.
        """
        cache = self._table_of_key.get(name)
        if cache is None:
            cache = self._table_of_key[name] = {}
        return cache

    def table_of_key(self, key: Any, name: str) -> dict[Any, Any]:
        """The ``key -> value`` table of state ``name`` in ``key``'s key group."""
        tables = self._group_tables(key)
        table = tables.get(name)
        if table is None:
            table = tables[name] = {}
        cache = self.key_tables(name)
        if len(cache) >= self._KEY_CACHE_SIZE:
            cache.clear()
        cache[key] = table
        return table

    def table_for_group(self, key_group: int, name: str) -> dict[Any, Any]:
        return self._groups.setdefault(key_group, {}).setdefault(name, {})

    def tables(self, name: str) -> Iterator[dict[Any, Any]]:
        """The ``key -> value`` table of state ``name`` of every key group that has one."""
        for tables in self._groups.values():
            table = tables.get(name)
            if table is not None:
                yield table

    def items(self, name: str) -> Iterator[tuple[Any, Any]]:
        """Every ``(key, value)`` of state ``name`` across all key groups."""
        for tables in self._groups.values():
            yield from tables.get(name, {}).items()

    def snapshot(self) -> dict[int, bytes]:
        """Serialized state per non-empty key group."""
        return {
            group: pickle.dumps(tables, protocol=pickle.HIGHEST_PROTOCOL)
            for group, tables in self._groups.items()
            if any(tables.values())
        }

    def restore(self, snapshots: Iterable[dict[int, bytes]]) -> None:
        """Load the key groups this backend owns from any number of snapshots."""
        for snapshot in snapshots:
            for group, blob in snapshot.items():
                if group in self.key_groups:
                    self._groups[group] = pickle.loads(blob)
        self._drop_caches()

    def _drop_caches(self) -> None:
        self._group_of_key.clear()
        for cache in self._table_of_key.values():
            cache.clear()
        if self._current_group is not None:
            self._current_group = self._group_tables(self._current_key)


class _KeyedState:
    def __init__(self, backend: KeyedStateBackend, name: str) -> None:
        self._backend = backend
        self._name = name

    def clear(self) -> None:
        """Forget the current key's value."""
        self._backend.table(self._name).pop(self._backend.current_key, None)


class ValueState(_KeyedState):
    """One value for the current key."""

    def __init__(self, backend: KeyedStateBackend, descriptor: ValueStateDescriptor) -> None:
        super().__init__(backend, descriptor.name)
        self._default = descriptor.default

    def value(self) -> Any:
        return self._backend.table(self._name).get(self._backend.current_key, self._default)

    def update(self, value: Any) -> None:
        self._backend.table(self._name)[self._backend.current_key] = value


class ListState(_KeyedState):
    """A list of values for the current key."""

    def get(self) -> list[Any]:
        return list(self._backend.table(self._name).get(self._backend.current_key, ()))

    def add(self, value: Any) -> None:
        self._backend.table(self._name).setdefault(self._backend.current_key, []).append(value)

    def add_all(self, values: Iterable[Any]) -> None:
        self._backend.table(self._name).setdefault(self._backend.current_key, []).extend(values)

    def update(self, values: Iterable[Any]) -> None:
        self._backend.table(self._name)[self._backend.current_key] = list(values)


class MapState(_KeyedState):
    """A dictionary for the current key."""

    def _map(self, create: bool = False) -> dict[Any, Any]:
        table = self._backend.table(self._name)
        key = self._backend.current_key
        if create:
            return table.setdefault(key, {})
        return table.get(key, {})

    def get(self, map_key: Any, default: Any = None) -> Any:
        return self._map().get(map_key, default)

    def put(self, map_key: Any, value: Any) -> None:
        self._map(create=True)[map_key] = value

    def put_all(self, entries: dict[Any, Any]) -> None:
        self._map(create=True).update(entries)

    def contains(self, map_key: Any) -> bool:
        return map_key in self._map()

    def remove(self, map_key: Any) -> None:
        self._map().pop(map_key, None)

    def keys(self) -> list[Any]:
        return list(self._map().keys())

    def values(self) -> list[Any]:
        return list(self._map().values())

    def items(self) -> list[tuple[Any, Any]]:
        return list(self._map().items())

    def is_empty(self) -> bool:
        return not self._map()


class ReducingState(_KeyedState):
    """One value for the current key, folded with the descriptor's reduce function."""

    def __init__(self, backend: KeyedStateBackend, descriptor: ReducingStateDescriptor) -> None:
        super().__init__(backend, descriptor.name)
        self._reduce = descriptor.reduce_function

    def get(self) -> Any:
        return self._backend.table(self._name).get(self._backend.current_key)

    def add(self, value: Any) -> None:
        table = self._backend.table(self._name)
        key = self._backend.current_key
        current = table.get(key, _MISSING)
        table[key] = value if current is _MISSING else self._reduce(current, value)
