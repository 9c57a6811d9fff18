"""Whether rayflow's per-record loops run in C in this process.

``pip install`` builds the optional C module :mod:`rayflow.runtime._speedups` where a C
compiler is at hand (``setup.py``); a keyed reduce's loop (:mod:`rayflow.runtime.reduce_loop`)
and a map's (:mod:`rayflow.runtime.map_loop`) then run there: the same steps in the same
order, with the same results and errors, without the interpreter's cost per step. Where it
was not built, or ``RAYFLOW_NO_SPEEDUPS`` is set to anything but ``0`` in the environment
of rayflow's processes when rayflow is imported, they run in Python.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["DISABLE_ENV", "MAX_COLUMNS", "loaded", "module"]

#: set to anything but ``0``: the loops run in Python
DISABLE_ENV = "RAYFLOW_NO_SPEEDUPS"

#: the most output columns a loop in C takes (an output with more runs in Python)
MAX_COLUMNS = 64


def _load() -> Any:
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    try:
        from rayflow.runtime import _speedups
    except ImportError:
        return None
    return _speedups


#: the C module, or None (read at each use: tests switch it)
module: Any = _load()


def loaded() -> bool:
    """Whether the per-record loops run in C in this process."""
    return module is not None
