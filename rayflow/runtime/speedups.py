"""Whether rayflow's per-record loops run in C in this process.

``pip install`` builds the optional C module :mod:`rayflow.runtime._speedups` where a C
compiler is at hand (``setup.py``); a keyed reduce's loop (:mod:`rayflow.runtime.reduce_loop`)
and a map's (:mod:`rayflow.runtime.map_loop`) then run there: the same steps in the same
order, with the same results and errors, without the interpreter's cost per step. Where it
was not built, or ``RAYFLOW_NO_SPEEDUPS`` is set to anything but ``0`` in the environment
of rayflow's processes when rayflow is imported, they run in Python.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["ABI", "DISABLE_ENV", "MAX_COLUMNS", "loaded", "module"]

_log = logging.getLogger(__name__)

#: the version of the C functions' arguments and results this Python code calls; a module
#: built from another version (an older build left in place by an editable install) is
#: not used
ABI = 4
_FUNCTIONS = ("reduce_columns", "map_columns", "pack_column", "unpack_column")

#: set to anything but ``0``: the loops run in Python
DISABLE_ENV = "RAYFLOW_NO_SPEEDUPS"

#: the most input or output columns a loop in C takes (more run in Python)
MAX_COLUMNS = 64


def _load() -> Any:
    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        return None
    try:
        from rayflow.runtime import _speedups
    except ImportError:
        return None
    built = getattr(_speedups, "ABI", None)
    if built != ABI or not all(hasattr(_speedups, name) for name in _FUNCTIONS):
        _log.warning(
            "rayflow's C loops at %s were built from another version (ABI %s, this rayflow "
            "calls %s): the loops run in Python; reinstall rayflow (pip install -e .) to "
            "rebuild them",
            getattr(_speedups, "__file__", "?"),
            built,
            ABI,
        )
        return None
    return _speedups


#: the C module, or None (read at each use: tests switch it)
module: Any = _load()


def loaded() -> bool:
    """Whether the per-record loops run in C in this process."""
    return module is not None
