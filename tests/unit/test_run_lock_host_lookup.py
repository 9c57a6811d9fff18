"""How the run lock reads a lock host's name (Ray's lookup mocked, no Ray started).

Ray can fail a lookup in other ways than "not found": right after a driver died, its
actor's name can still be registered while the class data of the driver's job is gone
already, and ``ray.get_actor`` fails with an AssertionError inside Ray. Such a lookup
says nothing about the host: it is looked up again (never read as gone, which would
hand a held lock to a second run), and an error that does not clear is raised naming
the host. Ray answers a lookup that failed with the same ValueError as an absent name, so
"not found" is confirmed in Ray's list of named actors before the host counts as gone."""

from __future__ import annotations

import pytest

from rayflow.runtime import run_lock


def _lookups(
    monkeypatch: pytest.MonkeyPatch, answers: list[object], listed: list[object] | None = None
) -> list[str]:
    """Ray's lookup answers ``answers`` in turn (the last one from then on); its list of
    named actors answers ``listed`` in turn (an exception is raised; default: empty)."""
    calls: list[str] = []
    listings = list(listed or [[]])

    def list_named_actors(all_namespaces: bool = False) -> list[dict[str, str]]:
        assert all_namespaces
        calls.append("list")
        listing = listings.pop(0) if len(listings) > 1 else listings[0]
        if isinstance(listing, BaseException):
            raise listing
        return [{"name": n, "namespace": run_lock.NAMESPACE} for n in listing]

    def get_actor(name: str, namespace: str | None = None) -> object:
        calls.append(name)
        answer = answers.pop(0) if answers else answers_last[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    answers_last = [answers[-1]]
    monkeypatch.setattr(run_lock.ray, "get_actor", get_actor)
    monkeypatch.setattr(run_lock.ray.util, "list_named_actors", list_named_actors)
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


def test_not_found_counts_as_gone_only_when_ray_lists_no_such_actor(monkeypatch):
    calls = _lookups(monkeypatch, [ValueError("no actor")])
    assert run_lock._host_alive("host-a") is False
    assert calls == ["host-a", "list"]
    other = {"name": "host-a", "namespace": "elsewhere"}  # same name, another namespace
    monkeypatch.setattr(run_lock.ray.util, "list_named_actors", lambda all_namespaces: [other])
    assert run_lock._host_alive("host-a") is False


def test_a_failed_lookup_of_a_host_ray_still_lists_says_alive(monkeypatch):
    """Ray answered a lookup that failed (not a missing name) with ValueError twice in a
    row: the host is listed, so its lock is still held."""
    _lookups(monkeypatch, [ValueError("Failed to look up actor")], listed=[["host-a"]])
    assert run_lock._host_alive("host-a") is True


def test_a_listing_that_fails_is_tried_again_never_read_as_gone(monkeypatch):
    listed = [ConnectionError("control store unreachable"), ["host-a"]]
    _lookups(monkeypatch, [ValueError("no actor")], listed=listed)
    assert run_lock._host_alive("host-a") is True
    monkeypatch.setattr(run_lock, "_LOOKUP_RETRY_S", 0.0)
    _lookups(monkeypatch, [ValueError("no actor")], listed=[ConnectionError("down")])
    with pytest.raises(RuntimeError, match="host-a"):
        run_lock._host_alive("host-a")
