"""The collector settings of a subtask's process (rayflow.runtime.gc_tuning)."""

from __future__ import annotations

import gc
import weakref

import pytest

from rayflow.runtime.gc_tuning import SUBTASK_GC_THRESHOLD0, tune_for_subtask, tune_gc


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_tune_gc_raises_the_young_threshold_only(thresholds):
    assert tune_gc() == thresholds
    assert gc.get_threshold() == (SUBTASK_GC_THRESHOLD0, thresholds[1], thresholds[2])


def test_cycles_are_still_collected_without_an_explicit_collect(thresholds):
    assert gc.isenabled()
    tune_gc(1000)
    gc.collect()
    first = _Node()
    gone = weakref.ref(first)
    del first
    # garbage cycles well past the threshold: the collector runs on its own
    for _ in range(20 * 1000):
        _Node()
    assert gone() is None


def test_a_process_that_is_not_an_actor_keeps_its_settings(thresholds):
    assert tune_for_subtask() is False
    assert gc.get_threshold() == thresholds
