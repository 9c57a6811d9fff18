"""``rayflow cluster``: its arguments, the spec's checks and the state file (no Ray)."""

from __future__ import annotations

import pytest

from rayflow.cli import build_parser
from rayflow.cluster_local import ClusterSpec, ClusterState, LocalCluster, NodeRecord


def test_cluster_subcommands_parse():
    parser = build_parser()
    args = parser.parse_args(["cluster", "up", "--workers", "3", "--auth", "disabled"])
    assert (args.action, args.workers, args.auth, args.name) == ("up", 3, "disabled", "local")
    assert parser.parse_args(["cluster", "down", "--name", "x", "--grace", "2"]).grace == 2
    assert parser.parse_args(["cluster", "status"]).action == "status"
    with pytest.raises(SystemExit):
        parser.parse_args(["cluster"])  # an action is required


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "Has Space"},
        {"name": "x" * 17},
        {"workers": -1},
        {"worker_cpus": -1},
        {"object_store_mb": 10},
        {"auth": "password"},
    ],
)
def test_cluster_spec_is_checked(kwargs):
    with pytest.raises(ValueError):
        ClusterSpec(**kwargs)


def test_state_round_trips_and_says_what_clients_export(tmp_path):
    cluster = LocalCluster(ClusterSpec(name="t", base_dir=str(tmp_path)))
    assert cluster.state() is None
    state = ClusterState(
        name="t",
        gcs_address="127.0.0.1:1234",
        dashboard_url=None,
        directory=str(tmp_path),
        auth="token",
        nodes=[NodeRecord("head", 99999999, 1, 1.0, "head.log", "abc")],
    )
    cluster._save(state)
    assert cluster.state() == state
    assert state.client_env() == {"RAY_ADDRESS": "127.0.0.1:1234", "RAY_AUTH_MODE": "token"}


def test_down_of_a_cluster_whose_processes_are_gone_only_forgets_it(tmp_path):
    cluster = LocalCluster(ClusterSpec(name="t", base_dir=str(tmp_path)))
    state = ClusterState("t", "127.0.0.1:1", None, str(tmp_path), "token")
    state.nodes.append(NodeRecord("head", 99999999, 1, 1.0, "head.log"))  # no such pid
    cluster._save(state)
    assert cluster.status()["up"] is False
    assert cluster.down(grace_s=0, progress=lambda _: None) == 0
    assert cluster.state() is None


def test_no_port_is_handed_out_twice_even_when_the_os_gives_one_again(monkeypatch):
    from rayflow import cluster_local

    ports = iter([41001, 41001, 41001, 41002])

    class _Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(ports)

        def getsockname(self):
            return ("0.0.0.0", self.port)

    monkeypatch.setattr(cluster_local.socket, "socket", _Socket)
    monkeypatch.setattr(cluster_local, "_GIVEN_PORTS", set())
    assert cluster_local._free_port() == 41001
    assert cluster_local._free_port() == 41002  # the OS gave 41001 twice more: skipped
