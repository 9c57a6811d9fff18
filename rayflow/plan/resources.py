"""What one operator asks of the cluster: :class:`ResourceSpec` (``set_resources``).

An operator's request is Ray's actor request (``num_cpus``, ``num_gpus``, ``memory``
and custom ``resources``), checked where it is set, so a mistake is reported at the
line that made it and not when Ray refuses an actor mid-deploy. Operators chained into
one subtask add up their requests (the subtask is one actor that runs them all); a
subtask of a vertex that asked for nothing gets the job's default
(:data:`DEFAULT_SUBTASK_CPUS` of a CPU: rayflow's subtasks are Ray actors that mostly
wait, and Ray's own default actor holds no CPU while it runs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_SUBTASK_CPUS", "ResourceSpec", "check_slot_sharing_group"]

#: CPUs reserved for a subtask whose operators asked for none: a token amount, so that a
#: placement group can hold it (a bundle must reserve something) while a 2-core machine
#: still runs jobs of hundreds of subtasks, as without placement.
DEFAULT_SUBTASK_CPUS = 0.001

#: Ray's smallest fraction of a resource.
_PRECISION = 1e-4

#: names Ray reserves for its keyword arguments
_RESERVED = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


def _quantity(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}")
    if value and abs(round(value / _PRECISION) * _PRECISION - value) > 1e-9:
        raise ValueError(
            f"{where}: {name}={value!r} is finer than Ray's resource precision (0.0001)"
        )
    return float(value)


@dataclass(frozen=True)
class ResourceSpec:
    """One operator's (or one chain's) request; ``None`` fields were not asked for."""

    num_cpus: float | None = None
    num_gpus: float | None = None
    memory: float | None = None  # bytes
    resources: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        where: str,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        memory: float | None = None,
        resources: Mapping[str, float] | None = None,
    ) -> ResourceSpec:
        """A checked request; ``where`` names the operator in error messages."""
        custom: dict[str, float] = {}
        if resources is not None:
            if not isinstance(resources, Mapping):
                raise TypeError(
                    f"{where}: resources must be a dict of name -> amount, got {resources!r}"
                )
            for name, value in resources.items():
                if not isinstance(name, str) or not name:
                    raise TypeError(f"{where}: resource names must be non-empty strings: {name!r}")
                if name in _RESERVED:
                    raise ValueError(
                        f"{where}: use {_RESERVED[name]}= instead of resources={{{name!r}: ...}}"
                    )
                custom[name] = _quantity(where, f"resources[{name!r}]", value)
        return cls(
            num_cpus=None if num_cpus is None else _quantity(where, "num_cpus", num_cpus),
            num_gpus=None if num_gpus is None else _quantity(where, "num_gpus", num_gpus),
            memory=None if memory is None else _quantity(where, "memory", memory),
            resources=custom,
        )

    @property
    def is_empty(self) -> bool:
        return (
            self.num_cpus is None
            and self.num_gpus is None
            and self.memory is None
            and not self.resources
        )

    def plus(self, other: ResourceSpec | None) -> ResourceSpec:
        """Both requests together (operators chained into one subtask)."""
        if other is None or other.is_empty:
            return self
        if self.is_empty:
            return other

        def add(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else a + b

        custom = dict(self.resources)
        for name, value in other.resources.items():
            custom[name] = custom.get(name, 0.0) + value
        return ResourceSpec(
            add(self.num_cpus, other.num_cpus),
            add(self.num_gpus, other.num_gpus),
            add(self.memory, other.memory),
            custom,
        )

    def over(self, base: ResourceSpec) -> ResourceSpec:
        """This request, with ``base``'s fields where this one asked for nothing (an
        operator's own request over the job-wide one)."""
        return ResourceSpec(
            base.num_cpus if self.num_cpus is None else self.num_cpus,
            base.num_gpus if self.num_gpus is None else self.num_gpus,
            base.memory if self.memory is None else self.memory,
            {**base.resources, **self.resources},
        )

    def actor_options(self, default_cpus: float = DEFAULT_SUBTASK_CPUS) -> dict[str, Any]:
        """Ray actor options for one subtask with this request."""
        options: dict[str, Any] = {
            "num_cpus": default_cpus if self.num_cpus is None else self.num_cpus
        }
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.memory:
            options["memory"] = int(self.memory)
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def bundle(self, default_cpus: float = DEFAULT_SUBTASK_CPUS) -> dict[str, float]:
        """The placement-group bundle that holds one subtask with this request (zeros
        left out; never empty: a bundle must reserve something)."""
        options = self.actor_options(default_cpus)
        bundle = {
            "CPU": options["num_cpus"],
            "GPU": options.get("num_gpus", 0.0),
            "memory": options.get("memory", 0.0),
            **options.get("resources", {}),
        }
        bundle = {k: round(v, 4) for k, v in bundle.items() if v}
        return bundle or {"CPU": DEFAULT_SUBTASK_CPUS}

    def describe(self) -> str:
        parts = []
        if self.num_cpus is not None:
            parts.append(f"num_cpus={self.num_cpus:g}")
        if self.num_gpus is not None:
            parts.append(f"num_gpus={self.num_gpus:g}")
        if self.memory is not None:
            parts.append(f"memory={self.memory:g}")
        if self.resources:
            parts.append(f"resources={dict(self.resources)}")
        return ", ".join(parts)


def check_slot_sharing_group(where: str, name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: slot sharing group must be a non-empty string, got {name!r}")
    return name
