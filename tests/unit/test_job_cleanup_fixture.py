"""The clean-up of jobs a test left running (tests/conftest.py) never starts a Ray: with
none initialized (the test shut its Ray down, and the job with it) it touches none, where
``ray.kill`` would start one, or connect to another session's on this machine, for the
tests after it."""

from __future__ import annotations

import ray

from tests.conftest import _end


class _Unreachable:
    """A client whose job master cannot be asked (its Ray is gone)."""

    _master = object()

    def get_job_status(self, timeout: float | None = None):
        raise ray.exceptions.RaySystemError("Ray has not been started yet")


def test_the_clean_up_of_a_job_whose_ray_is_gone_starts_no_ray(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # none, as after shutdown()
    started = []
    monkeypatch.setattr(ray, "init", lambda *a, **kw: started.append((a, kw)))
    _end(_Unreachable())
    assert started == []
