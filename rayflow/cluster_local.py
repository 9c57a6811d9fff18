"""A multi-node Ray cluster on one machine: ``rayflow cluster up | status | down``.

``up`` starts a head node and N worker nodes. Each node is one ``ray start --block``
process, the leader of a process group of its own that holds every Ray service of that
node, with its own CPUs and a custom resource that names it (``rayflow_node_head``,
``rayflow_node_w1``, ...: ``set_resources(resources={"rayflow_node_w1": 0.001})`` pins
an operator to that node). Every port Ray listens on is picked free (other Ray
instances may run on the machine), and each node has a Ray temp directory of its own
under the cluster's directory, as each machine of a real cluster has: nodes then never
share runtime environments being set up (one node's ``pip`` environment would be
deleted under another's), and a ``ray.init(address="auto")`` elsewhere on the machine
never finds the cluster by accident.

What ``up`` started is recorded in a state file (each node's pid, process group and
start time); ``down`` stops exactly that: SIGTERM to each recorded process group, SIGKILL
to what is left of them after a grace period, then SIGKILL to any process left that runs
in one of its nodes' Ray session directories (the Ray worker processes of its nodes). It never
runs ``ray stop``, which stops every Ray instance on the machine, other people's too.

Token authentication: Ray 2.x enables it for a new local cluster when a token exists in
``~/.ray/auth_token``, but a node or client that joins by address only uses it when
``RAY_AUTH_MODE=token`` is set. ``up`` therefore sets ``RAY_AUTH_MODE`` for every node
(``token`` by default, generating a token with ``ray get-auth-token --generate`` when there
is none; ``--auth disabled`` turns it off) and prints what clients must export.

Linux only (processes are found through ``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ClusterSpec", "ClusterState", "LocalCluster", "NodeRecord", "add_subcommand"]

#: ``ray`` of this Python: the nodes run the interpreter (and the Ray and rayflow installed
#: in it) that runs ``rayflow cluster up``, whatever ``ray`` is first on the PATH
RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]

#: what Ray needs to pass rayflow's 1 MiB messages inline on every node (see cluster/README.md)
NODE_ENV = {"RAY_max_direct_call_object_size": str(1 << 20)}

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,15}$")


def node_resource(node: str) -> str:
    """The custom resource that names a node of a local cluster."""
    return f"rayflow_node_{node}"


@dataclass(frozen=True)
class ClusterSpec:
    """What to start: ``workers`` worker nodes next to the head, their CPUs, object
    store sizes, the dashboard (``ray job submit`` needs it) and the auth mode."""

    name: str = "local"
    workers: int = 2
    head_cpus: float = 1
    worker_cpus: float = 2
    object_store_mb: int = 256
    dashboard: bool = True
    auth: str = "token"
    base_dir: str | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"cluster name must be 1-16 of a-z, 0-9 and '-' (the Ray temp directory's "
                f"socket paths must stay short), got {self.name!r}"
            )
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.head_cpus < 0 or self.worker_cpus < 0:
            raise ValueError("CPUs must be >= 0")
        if self.object_store_mb < 80:
            raise ValueError("object_store_mb must be >= 80 (Ray's minimum is 75 MiB)")
        if self.auth not in ("token", "disabled"):
            raise ValueError(f"auth must be 'token' or 'disabled', got {self.auth!r}")

    @property
    def directory(self) -> Path:
        base = self.base_dir or os.path.join(tempfile.gettempdir(), f"rayflow-cluster-{self.name}")
        return Path(base)


@dataclass
class NodeRecord:
    name: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat start time: a reused pid is not ours
    num_cpus: float
    log: str
    node_id: str | None = None
    #: the node's Prometheus endpoint for Ray's and rayflow's metrics
    metrics_port: int | None = None


@dataclass
class ClusterState:
    name: str
    gcs_address: str
    dashboard_url: str | None
    #: state, logs and every node's Ray temp directory
    directory: str
    auth: str
    nodes: list[NodeRecord] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        raw = json.loads(text)
        raw["nodes"] = [NodeRecord(**n) for n in raw.get("nodes", [])]
        return cls(**raw)

    def client_env(self) -> dict[str, str]:
        """What a client (driver, ``ray job submit``, ``ray status``) of the cluster sets."""
        env = {"RAY_ADDRESS": self.gcs_address, "RAY_AUTH_MODE": self.auth}
        return env


# --- processes ---------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int] | None:
    """(process group, start time in ticks) of a live process, None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie holds nothing
    return int(fields[2]), int(fields[19])


def _processes() -> Iterable[tuple[int, int, str]]:
    """(pid, process group, command line) of every live process of this user."""
    uid = os.getuid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != uid:
                continue
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        stat = _stat(pid)
        if stat is not None:
            yield pid, stat[0], cmdline


def _alive(node: NodeRecord) -> bool:
    stat = _stat(node.pid)
    return stat is not None and stat[1] == node.start_ticks


#: ports :func:`_free_port` handed out in this process
_GIVEN_PORTS: set[int] = set()


def _free_port() -> int:
    """A port free now that this process has not handed out before: the OS may give one
    ephemeral port to two binds in a row once the first socket is closed, and a node
    whose GCS and client server were given the same port does not start."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port
    raise RuntimeError("found no free port that was not handed out already")


def _port_open(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


_NODES_PROBE = """
import json, sys, time
import ray
want, timeout = int(sys.argv[1]), float(sys.argv[2])
ray.init(address=sys.argv[3], logging_level="ERROR", log_to_driver=False)
deadline = time.time() + timeout
while True:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) >= want or time.time() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([{"node_id": n["NodeID"], "resources": n["Resources"]} for n in nodes]))
"""


class LocalCluster:
    """A local multi-node cluster, started and stopped through its state file."""

    def __init__(self, spec: ClusterSpec | None = None) -> None:
        self.spec = spec or ClusterSpec()
        self.directory = self.spec.directory
        self.state_file = self.directory / "state.json"

    # --- state ---------------------------------------------------------------------------

    def state(self) -> ClusterState | None:
        try:
            return ClusterState.from_json(self.state_file.read_text())
        except FileNotFoundError:
            return None

    def _save(self, state: ClusterState) -> None:
        temp = self.state_file.with_suffix(".tmp")
        temp.write_text(state.to_json())
        os.replace(temp, self.state_file)

    # --- up ------------------------------------------------------------------------------

    def _node_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in NODE_ENV.items():
            env.setdefault(key, value)
        env["RAY_AUTH_MODE"] = self.spec.auth
        env.pop("RAY_ADDRESS", None)
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        return env

    def _ensure_token(self) -> None:
        if self.spec.auth != "token":
            return
        subprocess.run(
            [*RAY_CLI, "get-auth-token", "--generate"],
            check=True,
            stdout=subprocess.DEVNULL,  # the token itself is never printed
            stderr=subprocess.DEVNULL,
            env=self._node_env(),
        )

    def _start_node(self, name: str, args: list[str], num_cpus: float) -> NodeRecord:
        log = self.directory / "logs" / f"{name}.log"
        metrics_port = _free_port()
        command = [
            *RAY_CLI,
            "start",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus:g}",
            f"--resources={json.dumps({node_resource(name): 1})}",
            f"--object-store-memory={self.spec.object_store_mb * 1024 * 1024}",
            f"--temp-dir={self.directory / name}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--metrics-export-port={metrics_port}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            "--disable-usage-stats",
            *args,
        ]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._node_env(),
                start_new_session=True,  # a process group of its own: what `down` stops
            )
        stat = _stat(proc.pid)
        return NodeRecord(
            name, proc.pid, stat[1] if stat else 0, num_cpus, str(log), metrics_port=metrics_port
        )

    def up(self, timeout_s: float = 120.0, progress: Any = print) -> ClusterState:
        """Start the cluster; returns its state once every node is alive."""
        spec = self.spec
        old = self.state()
        if old is not None and any(_alive(n) for n in old.nodes):
            raise RuntimeError(
                f"cluster {spec.name!r} is already up ({self.state_file}); "
                f"`rayflow cluster down --name {spec.name}` first"
            )
        self._clear_directory()
        (self.directory / "logs").mkdir(parents=True)
        self._ensure_token()
        gcs = f"127.0.0.1:{_free_port()}"
        dashboard_port = _free_port()
        state = ClusterState(
            name=spec.name,
            gcs_address=gcs,
            dashboard_url=f"http://127.0.0.1:{dashboard_port}" if spec.dashboard else None,
            directory=str(self.directory),
            auth=spec.auth,
        )
        head_args = [
            "--head",
            f"--port={gcs.rsplit(':', 1)[1]}",
            f"--ray-client-server-port={_free_port()}",
            f"--include-dashboard={'true' if spec.dashboard else 'false'}",
        ]
        if spec.dashboard:
            head_args += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
        try:
            progress(f"starting head node (GCS {gcs}) ...")
            state.nodes.append(self._start_node("head", head_args, spec.head_cpus))
            self._save(state)
            self._wait_for(lambda: _port_open(gcs), state.nodes[0], timeout_s, "the head's GCS")
            for i in range(1, spec.workers + 1):
                progress(f"starting worker node w{i} ...")
                node = self._start_node(f"w{i}", [f"--address={gcs}"], spec.worker_cpus)
                state.nodes.append(node)
                self._save(state)
            nodes = self._probe(state, want=len(state.nodes), timeout_s=timeout_s)
            self._assign_node_ids(state, nodes)
            missing = [n.name for n in state.nodes if n.node_id is None]
            if missing:
                raise RuntimeError(f"nodes {missing} did not join within {timeout_s:g} s")
            if spec.dashboard:
                url = state.dashboard_url
                self._wait_for(
                    lambda: _port_open(url.split("//", 1)[1]), state.nodes[0], timeout_s, url
                )
            self._save(state)
        except BaseException as exc:
            progress(f"start failed ({exc}); stopping what was started")
            self.down(progress=lambda _: None)
            raise
        return state

    def _clear_directory(self) -> None:
        """Remove what an earlier cluster of this name left (logs, node temp dirs); a
        directory holding anything else is not ours and is refused."""
        if not self.directory.exists():
            return
        ours = re.compile(r"^(state\.json|state\.tmp|logs|head|w\d+)$")
        foreign = [p.name for p in self.directory.iterdir() if not ours.match(p.name)]
        if foreign:
            raise RuntimeError(
                f"{self.directory} holds files that are not a local cluster's "
                f"({', '.join(sorted(foreign)[:5])}); choose another --dir or --name"
            )
        for path in self.directory.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    @staticmethod
    def _wait_for(ready: Any, node: NodeRecord, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not _alive(node):
                tail = Path(node.log).read_text()[-2000:]
                raise RuntimeError(f"node {node.name} exited while waiting for {what}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not up after {timeout_s:g} s (see {node.log})")
            time.sleep(0.2)

    def _probe(
        self, state: ClusterState, want: int = 0, timeout_s: float = 10.0
    ) -> list[dict[str, Any]]:
        """The cluster's live nodes, asked by a short-lived driver (in a process of its
        own: the caller may be connected to another Ray)."""
        env = self._node_env()
        result = subprocess.run(
            [sys.executable, "-c", _NODES_PROBE, str(want), str(timeout_s), state.gcs_address],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s + 60,
        )
        if result.returncode != 0:
            raise RuntimeError(f"cannot reach the cluster's GCS: {result.stderr.strip()[-500:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    @staticmethod
    def _assign_node_ids(state: ClusterState, nodes: list[dict[str, Any]]) -> None:
        for record in state.nodes:
            label = node_resource(record.name)
            record.node_id = next(
                (n["node_id"] for n in nodes if label in n["resources"]), record.node_id
            )

    # --- status --------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The recorded nodes: process alive, and node alive in the GCS."""
        state = self.state()
        if state is None:
            return {"name": self.spec.name, "up": False}
        processes = {n.name: _alive(n) for n in state.nodes}
        alive_ids: set[str] | None = None
        if any(processes.values()):
            try:
                alive_ids = {n["node_id"] for n in self._probe(state)}
            except Exception:  # noqa: BLE001 - GCS down: processes say what is left
                alive_ids = None
        return {
            "name": state.name,
            "up": any(processes.values()),
            "address": state.gcs_address,
            "dashboard": state.dashboard_url,
            "auth": state.auth,
            "state_file": str(self.state_file),
            "nodes": [
                {
                    "name": n.name,
                    "pid": n.pid,
                    "cpus": n.num_cpus,
                    "resource": node_resource(n.name),
                    "process": "alive" if processes[n.name] else "gone",
                    "node_id": n.node_id,
                    "in_cluster": None if alive_ids is None else n.node_id in alive_ids,
                    "metrics_port": n.metrics_port,
                }
                for n in state.nodes
            ],
        }

    # --- down ----------------------------------------------------------------------------

    def leftovers(self, state: ClusterState | None = None) -> list[int]:
        """Pids of this cluster's processes: its nodes' process groups, and whatever runs
        out of its temp directory."""
        state = state or self.state()
        if state is None:
            return []
        # a node's process group keeps its leader's pid as id, also after the leader
        # exited; a member must also be a Ray process (a recycled id is not ours)
        groups = {n.pid for n in state.nodes}
        # a worker process names its node's session directory (--session-dir, sockets)
        base = state.directory.rstrip("/")
        markers = [f"{base}/{n.name}/session_" for n in state.nodes]
        me = os.getpid()
        return sorted(
            pid
            for pid, pgid, cmdline in _processes()
            if pid != me
            and ((pgid in groups and "ray" in cmdline) or any(m in cmdline for m in markers))
        )

    def down(self, grace_s: float = 10.0, progress: Any = print) -> int:
        """Stop what ``up`` started; returns how many processes had to be killed."""
        state = self.state()
        if state is None:
            progress(f"cluster {self.spec.name!r}: nothing recorded in {self.state_file}")
            return 0
        for node in reversed(state.nodes):  # workers first, the head last
            if _alive(node):
                progress(f"stopping node {node.name} (process group {node.pid})")
                try:
                    os.killpg(node.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while self.leftovers(state) and time.monotonic() < deadline:
            time.sleep(0.2)
        killed = 0
        for _ in range(3):
            left = self.leftovers(state)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        left = self.leftovers(state)
        if left:
            raise RuntimeError(f"cluster {state.name!r}: processes {left} survived SIGKILL")
        self.state_file.unlink(missing_ok=True)
        progress(f"cluster {state.name!r} is down (logs in {self.directory / 'logs'})")
        return killed


# --- the `rayflow cluster` command --------------------------------------------------------


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``rayflow cluster up | status | down``."""
    parser = subparsers.add_parser(
        "cluster",
        help="start, inspect or stop a multi-node Ray cluster on this machine",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1]
        + " Stops exactly what it started; never runs `ray stop`.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start a head node and N worker nodes")
    up.add_argument("--workers", type=int, default=2, help="worker nodes (default 2)")
    up.add_argument("--head-cpus", type=float, default=1, help="CPUs of the head (default 1)")
    up.add_argument("--worker-cpus", type=float, default=2, help="CPUs per worker (default 2)")
    up.add_argument(
        "--object-store-mb", type=int, default=256, help="object store per node (default 256)"
    )
    up.add_argument(
        "--no-dashboard", action="store_true", help="no dashboard (no `ray job submit`)"
    )
    up.add_argument(
        "--auth",
        choices=("token", "disabled"),
        default="token",
        help="Ray's token authentication (RAY_AUTH_MODE) for every node (default token)",
    )
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for nodes")
    status = actions.add_parser("status", help="the recorded nodes and whether they run")
    down = actions.add_parser("down", help="stop exactly the processes `up` started")
    down.add_argument("--grace", type=float, default=10.0, help="seconds before SIGKILL")
    for action in (up, status, down):
        action.add_argument("--name", default="local", help="cluster name (default local)")
        action.add_argument(
            "--dir",
            default=None,
            help="state, logs and Ray temp dir (default /tmp/rayflow-cluster-NAME)",
        )
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        if args.action == "up":
            spec = ClusterSpec(
                name=args.name,
                workers=args.workers,
                head_cpus=args.head_cpus,
                worker_cpus=args.worker_cpus,
                object_store_mb=args.object_store_mb,
                dashboard=not args.no_dashboard,
                auth=args.auth,
                base_dir=args.dir,
            )
            state = LocalCluster(spec).up(timeout_s=args.timeout)
            print(_describe_up(state))
            return 0
        cluster = LocalCluster(ClusterSpec(name=args.name, base_dir=args.dir))
        if args.action == "status":
            status = cluster.status()
            print(_describe_status(status))
            return 0 if status["up"] else 1
        cluster.down(grace_s=args.grace)
        return 0
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"rayflow cluster {args.action}: error: {exc}", file=sys.stderr)
        return 1


def _describe_up(state: ClusterState) -> str:
    lines = [f"cluster {state.name!r} is up: {len(state.nodes)} nodes"]
    for n in state.nodes:
        lines.append(
            f"  {n.name:<5} {n.num_cpus:g} CPU  resource {node_resource(n.name)}  node {n.node_id}"
        )
        if n.metrics_port:
            lines.append(f"        metrics: http://127.0.0.1:{n.metrics_port}/metrics")
    lines.append(f"  dashboard: {state.dashboard_url or 'off'}")
    lines.append("use it from this machine with:")
    for key, value in state.client_env().items():
        lines.append(f"  export {key}={value}")
    if state.dashboard_url:
        lines.append(f"  ray job submit --address {state.dashboard_url} ...")
    lines.append(f"stop it with: rayflow cluster down --name {state.name}")
    return "\n".join(lines)


def _describe_status(status: dict[str, Any]) -> str:
    if "nodes" not in status:
        return f"cluster {status['name']!r}: not up (nothing recorded)"
    head = "up" if status["up"] else "down"
    lines = [
        f"cluster {status['name']!r}: {head}, address {status['address']}, dashboard "
        f"{status['dashboard'] or 'off'}, RAY_AUTH_MODE={status['auth']}"
    ]
    for n in status["nodes"]:
        where = {True: "alive in the cluster", False: "not in the cluster", None: "GCS unreachable"}
        lines.append(
            f"  {n['name']:<5} pid {n['pid']:<8} process {n['process']:<5} "
            f"{n['cpus']:g} CPU  {n['resource']}  {where[n['in_cluster']]}"
        )
        if n.get("metrics_port"):
            lines.append(f"        metrics: http://127.0.0.1:{n['metrics_port']}/metrics")
    return "\n".join(lines)
