"""How the run lock reads a lock host's name (Ray's lookup mocked, no Ray started).

Ray can fail a lookup in other ways than "not found": right after a driver died, its
actor's name can still be registered while the class data of the driver's job is gone
already, and ``ray.get_actor`` fails with an AssertionError inside Ray. Such a lookup
says nothing about the host: it is looked up again (never read as gone, which would
hand a held lock to a second run), and an error that does not clear is raised naming
the host."""

from __future__ import annotations

import pytest

from rayflow.runtime import run_lock


def _lookups(monkeypatch: pytest.MonkeyPatch, answers: list[object]) -> list[str]:
    calls: list[str] = []

    def get_actor(name: str, namespace: str | None = None) -> object:
        calls.append(name)
        answer = answers.pop(0) if answers else answers_last[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    answers_last = [answers[-1]]
    monkeypatch.setattr(run_lock.ray, "get_actor", get_actor)
    monkeypatch.setattr(run_lock.time, "sleep", lambda s: None)
    return calls


def _ray_race() -> AssertionError:
    return AssertionError("Expected str or bytes, got <class 'NoneType'>")


def test_a_lookup_that_fails_inside_ray_is_tried_again_until_the_name_is_gone(monkeypatch):
    calls = _lookups(monkeypatch, [_ray_race(), _ray_race(), ValueError("no actor")])
    assert run_lock._host_alive("host-a") is False
    assert len(calls) >= 3


def test_a_lookup_that_fails_inside_ray_then_finds_the_host_says_alive(monkeypatch):
    _lookups(monkeypatch, [_ray_race(), object()])
    assert run_lock._host_alive("host-a") is True


def test_a_lookup_that_keeps_failing_is_raised_naming_the_host(monkeypatch):
    monkeypatch.setattr(run_lock, "_LOOKUP_RETRY_S", 0.0)
    _lookups(monkeypatch, [_ray_race()])
    with pytest.raises(RuntimeError, match="host-a") as info:
        run_lock._host_alive("host-a")
    assert isinstance(info.value.__cause__, AssertionError)


def test_not_found_is_looked_up_once_more_before_it_counts_as_gone(monkeypatch):
    calls = _lookups(monkeypatch, [ValueError("no actor"), object()])
    assert run_lock._host_alive("host-a") is True
    calls = _lookups(monkeypatch, [ValueError("no actor"), ValueError("no actor")])
    assert run_lock._host_alive("host-a") is False
    assert len(calls) == 2
