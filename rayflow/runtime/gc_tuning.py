"""The cyclic garbage collector's settings in a subtask's worker process.

Every subtask runs in a Ray worker process of its own (an actor's process runs nothing
else and ends with the actor; rayflow never reuses one across jobs), so the process-wide
collector settings are the subtask's to choose there. Per-record operators allocate and
free two or three dicts per record; CPython starts a young-generation collection every
700 net allocations of container objects, some 25 per 8192-row batch, each walking the
lists of the batch's records again. :func:`tune_for_subtask` raises that threshold to
:data:`SUBTASK_GC_THRESHOLD0`: cyclic garbage is still collected, after at most that
many net allocations (so memory stays bounded), but far less often. Reference counting
frees everything that is not part of a cycle at once, as before.

The objects the process holds when its first subtask starts (the modules of Ray,
pyarrow and rayflow, the deployment) are moved to the collector's permanent generation
(``gc.freeze()``): they live as long as the process, and a full collection no longer
walks them (tens of thousands of objects: 40-140 ms a full collection, a pause of every
record in flight at the time). Reference counting still frees any of them that is
dropped; only a cycle among them is never collected.

Only a subtask's own actor process is tuned: a ``Subtask`` built in another process
(a driver, a test) leaves that process's settings alone.
"""

from __future__ import annotations

import gc

__all__ = ["SUBTASK_GC_THRESHOLD0", "tune_for_subtask", "tune_gc"]

#: Net container allocations between young-generation collections in a subtask's process
#: (CPython's default is 700).
SUBTASK_GC_THRESHOLD0 = 50_000


def tune_gc(threshold0: int = SUBTASK_GC_THRESHOLD0) -> tuple[int, int, int]:
    """Set the young generation's threshold to ``threshold0`` (the older generations'
    keep theirs); returns the thresholds before."""
    before = gc.get_threshold()
    gc.set_threshold(threshold0, before[1], before[2])
    return before


def tune_for_subtask() -> bool:
    """:func:`tune_gc` when this process is a Ray actor's (a subtask's own worker);
    True when it did."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        actor = ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - no runtime context: not an actor's process
        return False
    if actor is None:
        return False
    tune_gc()
    gc.freeze()  # what the process holds at start lives as long as it: never walked again
    return True
