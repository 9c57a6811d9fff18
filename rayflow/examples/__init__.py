"""Small runnable jobs that ship with rayflow: ``rayflow run --example NAME [ARGS...]``
(or ``python -m rayflow.examples.NAME``).

- ``wordcount``: the smallest complete job (lines -> words -> count per word);
- ``orders``: the orders job of :mod:`rayflow.jobs.orders` (synthetic orders -> enrich ->
  running total per customer, checked against a direct computation).
"""

from __future__ import annotations

import importlib.util
import pkgutil

__all__ = ["names", "path_of"]


def names() -> list[str]:
    """The examples' names, sorted."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def path_of(name: str) -> str:
    """The file of example ``name`` (KeyError naming the examples when there is none)."""
    if name not in names():
        raise KeyError(f"no example {name!r} (examples: {', '.join(names())})")
    spec = importlib.util.find_spec(f"{__name__}.{name}")
    assert spec is not None and spec.origin is not None
    return spec.origin
