"""Where a job's subtasks run: one Ray placement group per job master, a bundle per slot.

**The plan** (:class:`PlacementPlan`, plain code over the job graph): every subtask has
a bundle of its own, so with Ray's SPREAD strategy the subtasks of a job spread over
the cluster's nodes; subtask i of every vertex in one slot sharing group shares bundle
i instead (Flink's slot sharing: a pipeline's subtasks on one node). A bundle reserves
what its subtasks ask for (``set_resources``; a token 0.001 CPU for those that ask for
nothing), and each subtask's actor asks for exactly its share of it.

**The group** (:class:`JobPlacement`) belongs to the job master that created it: it is
created when the job master starts running the job, reused by every attempt (a
restarted subtask's actor goes into the same bundle) and removed when the job master's
run ends, finished, failed or cancelled. Ray removes a group on its own only once both
the actor that created it and its Ray job (the driver) are gone, so the client removes
the groups of a job master it replaces or lets go (:func:`remove_job_placement_groups`);
the next job master creates its own.

Before each attempt deploys, every bundle must be placed: after a node is lost, Ray
moves its bundles to other nodes once it has declared the node dead, and an attempt
waits for that (also while Ray still counts a node as alive whose raylet no longer
accepts connections) for at most ``ready_timeout_s``, then fails with the bundles it misses
and what the cluster has left (the restart strategy decides what follows). While an
attempt runs, a watch fails it the same way when bundles stay unplaced that long
(subtasks waiting for a bundle would otherwise wait forever).

Subtask options of the job (``set_subtask_options``) with a ``scheduling_strategy`` or
``placement_group`` of their own turn the job's placement group off.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from rayflow.plan.physical import JobGraph
from rayflow.plan.resources import DEFAULT_SUBTASK_CPUS, ResourceSpec

__all__ = [
    "PlacementConfig",
    "PlacementPlan",
    "PlacementStrategy",
    "PlacementTimeoutError",
    "JobPlacement",
    "job_placement_groups",
    "remove_job_placement_groups",
]

log = logging.getLogger("rayflow.placement")

SubtaskKey = tuple[int, int]

#: how often a running attempt checks that every bundle is still placed
WATCH_INTERVAL_S = 2.0

#: subtask option names that are resource requests (the job-wide default request)
_RESOURCE_OPTIONS = ("num_cpus", "num_gpus", "memory", "resources")


class PlacementStrategy(str, enum.Enum):
    """Ray's placement group strategies, and NONE: no placement group (Ray places each
    subtask actor on its own)."""

    SPREAD = "SPREAD"
    PACK = "PACK"
    STRICT_SPREAD = "STRICT_SPREAD"
    STRICT_PACK = "STRICT_PACK"
    NONE = "NONE"


@dataclass(frozen=True)
class PlacementConfig:
    strategy: PlacementStrategy = PlacementStrategy.SPREAD
    #: how long an attempt waits for every bundle to be placed before it fails
    ready_timeout_s: float = 60.0

    @classmethod
    def of(cls, strategy: PlacementStrategy | str, ready_timeout_s: float) -> PlacementConfig:
        if isinstance(strategy, str) and not isinstance(strategy, PlacementStrategy):
            try:
                strategy = PlacementStrategy(strategy.upper())
            except ValueError:
                names = ", ".join(s.value for s in PlacementStrategy)
                raise ValueError(
                    f"set_placement: strategy must be one of {names}, got {strategy!r}"
                ) from None
        if not isinstance(strategy, PlacementStrategy):
            raise TypeError(f"set_placement: strategy must be a PlacementStrategy: {strategy!r}")
        if (
            isinstance(ready_timeout_s, bool)
            or not isinstance(ready_timeout_s, (int, float))
            or not ready_timeout_s > 0
        ):
            raise ValueError(
                f"set_placement: ready_timeout_s must be a number > 0, got {ready_timeout_s!r}"
            )
        return cls(strategy, float(ready_timeout_s))


class PlacementTimeoutError(RuntimeError):
    """Bundles of the job's placement group stayed unplaced longer than allowed."""


@dataclass(frozen=True)
class PlacementPlan:
    """Which bundle each subtask goes in, what each bundle reserves, and what each
    subtask's actor asks for. ``bundles`` is empty when the job has no placement group."""

    bundles: list[dict[str, float]] = field(default_factory=list)
    bundle_of: dict[SubtaskKey, int] = field(default_factory=dict)
    #: Ray actor resource options per vertex ({} keeps Ray's defaults)
    requests: dict[int, dict[str, Any]] = field(default_factory=dict)
    strategy: PlacementStrategy = PlacementStrategy.NONE
    #: per bundle, the subtasks in it (for messages)
    members: list[list[str]] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        graph: JobGraph,
        subtask_options: dict[str, Any] | None = None,
        config: PlacementConfig | None = None,
    ) -> PlacementPlan:
        options = subtask_options or {}
        config = config or PlacementConfig()
        base = ResourceSpec.of(
            "set_subtask_options", **{k: options[k] for k in _RESOURCE_OPTIONS if k in options}
        )
        strategy = config.strategy
        if "scheduling_strategy" in options or "placement_group" in options:
            strategy = PlacementStrategy.NONE
        placed = strategy is not PlacementStrategy.NONE
        requests: dict[int, dict[str, Any]] = {}
        specs: dict[int, ResourceSpec] = {}
        for vertex_id, vertex in graph.vertices.items():
            spec = vertex.resources.over(base)
            specs[vertex_id] = spec
            if placed or not spec.is_empty:
                requests[vertex_id] = spec.actor_options(DEFAULT_SUBTASK_CPUS)
            else:
                requests[vertex_id] = {}
        if not placed:
            return cls(requests=requests)
        slots: dict[Any, int] = {}
        bundles: list[dict[str, float]] = []
        members: list[list[str]] = []
        bundle_of: dict[SubtaskKey, int] = {}
        for vertex_id in graph.topological_order():
            vertex = graph.vertices[vertex_id]
            share = specs[vertex_id].bundle(DEFAULT_SUBTASK_CPUS)
            group = vertex.slot_sharing_group
            for index in range(vertex.parallelism):
                slot = ("group", group, index) if group is not None else ("own", vertex_id, index)
                if slot not in slots:
                    slots[slot] = len(bundles)
                    bundles.append({})
                    members.append([])
                b = slots[slot]
                for name, amount in share.items():
                    bundles[b][name] = round(bundles[b].get(name, 0.0) + amount, 4)
                members[b].append(f"{vertex.name}#{index}")
                bundle_of[(vertex_id, index)] = b
        return cls(
            bundles=bundles,
            bundle_of=bundle_of,
            requests=requests,
            strategy=strategy,
            members=members,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.bundles)


def _placed_bundles(table: dict[str, Any]) -> set[int]:
    """Indices of the bundles that are on a node."""
    return {
        int(i)
        for i, node in table.get("bundles_to_node_id", {}).items()
        if node and node.strip("f0") != ""
    }


def _unreachable_nodes(node_ids: set[str], timeout_s: float = 1.0) -> set[str]:
    """The nodes among ``node_ids`` that are dead, or whose raylet does not accept a
    connection (gone, but not yet declared dead by Ray)."""
    import ray

    nodes = {n["NodeID"]: n for n in ray.nodes()}
    unreachable = set()
    for node_id in node_ids:
        node = nodes.get(node_id)
        if node is None or not node.get("Alive"):
            unreachable.add(node_id)
            continue
        try:
            address = (node["NodeManagerAddress"], int(node["NodeManagerPort"]))
            socket.create_connection(address, timeout=timeout_s).close()
        except (OSError, KeyError, ValueError):
            unreachable.add(node_id)
    return unreachable


def _table(pg: Any) -> dict[str, Any]:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(pg)


class JobPlacement:
    """The placement group of one job master's run (see the module docstring)."""

    def __init__(
        self, plan: PlacementPlan, config: PlacementConfig, name: str, job_name: str = ""
    ) -> None:
        self.plan = plan
        self.config = config
        self.name = name
        self.job_name = job_name
        self.group: Any = None
        self._removed = False
        self._ensured = False
        self._reported: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.plan.enabled

    def create(self) -> None:
        """Ask Ray for the group (returns at once; :meth:`ensure` waits for it)."""
        if not self.enabled or self.group is not None or self._removed:
            return
        from ray.util.placement_group import placement_group

        self.group = placement_group(
            self.plan.bundles, strategy=self.plan.strategy.value, name=self.name
        )

    async def ensure(self, timeout_s: float | None = None) -> None:
        """Return once every bundle is placed; raise :class:`PlacementTimeoutError` after
        ``timeout_s`` (the configured ``ready_timeout_s`` by default)."""
        if not self.enabled:
            return
        if self._removed:
            raise RuntimeError(f"placement group {self.name} was removed")
        self.create()
        timeout_s = self.config.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        # the first time: Ray tells when the group is created, no polling
        try:
            await asyncio.wait_for(self.group.ready(), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise PlacementTimeoutError(await self._describe_unplaced(timeout_s)) from None
        # After the first attempt a node may be gone that Ray has not yet declared dead
        # (that takes its health checks ~15 s): its bundles still count as placed, and a
        # subtask deployed into one would fail once more when Ray does. So the nodes of
        # the bundles must also answer.
        probe, self._ensured = self._ensured, True
        pause = 0.05
        while True:
            table = await asyncio.to_thread(_table, self.group)
            unreachable: set[str] = set()
            if self._placed(table):
                if not probe:
                    return
                nodes = {n for n in table["bundles_to_node_id"].values() if n}
                unreachable = await asyncio.to_thread(_unreachable_nodes, nodes)
                if not unreachable:
                    return
                if unreachable != self._reported:
                    log.warning(
                        "job %r: waiting for Ray to move placement bundles off nodes that do "
                        "not answer: %s",
                        self.job_name,
                        sorted(n[:12] for n in unreachable),
                    )
                    self._reported = unreachable
            if time.monotonic() >= deadline:
                raise PlacementTimeoutError(
                    await self._describe_unplaced(timeout_s, table, unreachable)
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _placed(self, table: dict[str, Any]) -> bool:
        return table.get("state") == "CREATED" and len(_placed_bundles(table)) == len(
            self.plan.bundles
        )

    async def watch(self, interval_s: float = WATCH_INTERVAL_S) -> str:
        """Return (with the reason) only when bundles stay unplaced longer than
        ``ready_timeout_s`` while an attempt runs; never returns without a group."""
        if not self.enabled or self.group is None:
            await asyncio.Event().wait()
        unplaced_since: float | None = None
        while True:
            await asyncio.sleep(interval_s)
            try:
                table = await asyncio.to_thread(_table, self.group)
            except Exception as exc:  # noqa: BLE001 - GCS busy for a moment: ask again
                log.debug("placement group %s: %s", self.name, exc)
                continue
            if self._placed(table):
                unplaced_since = None
                continue
            now = time.monotonic()
            unplaced_since = unplaced_since or now
            if now - unplaced_since >= self.config.ready_timeout_s:
                return await self._describe_unplaced(now - unplaced_since, table)

    async def _describe_unplaced(
        self,
        waited_s: float,
        table: dict[str, Any] | None = None,
        unreachable: set[str] | None = None,
    ) -> str:
        try:
            import ray

            table = table or await asyncio.to_thread(_table, self.group)
            available = await asyncio.to_thread(ray.available_resources)
            alive = await asyncio.to_thread(lambda: sum(1 for n in ray.nodes() if n["Alive"]))
        except Exception as exc:  # noqa: BLE001 - the message says less, that is all
            table, available, alive = table or {}, {"unknown": str(exc)}, "?"
        placed = _placed_bundles(table)
        on_node = table.get("bundles_to_node_id", {})
        missing = [
            i
            for i in range(len(self.plan.bundles))
            if i not in placed or on_node.get(i) in (unreachable or ())
        ]
        shown = "; ".join(
            f"bundle {i} {self.plan.bundles[i]} for {', '.join(self.plan.members[i][:3])}"
            for i in missing[:5]
        )
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        free = {k: round(v, 4) for k, v in sorted(available.items()) if not k.startswith("node:")}
        job = f"job {self.job_name!r}: " if self.job_name else ""
        state = table.get("stats", {}).get("scheduling_state")
        scheduling = f" ({state})" if state else ""
        if unreachable:
            shown += f" (on nodes that do not answer: {sorted(n[:12] for n in unreachable)})"
        return (
            f"{job}{len(missing)} of {len(self.plan.bundles)} placement bundles not placed "
            f"after {waited_s:.0f} s (placement group {self.name}, state "
            f"{table.get('state', 'unknown')}{scheduling}, strategy "
            f"{self.plan.strategy.value}): {shown}"
            f"{more}. Nodes alive: {alive}; available: {free}. Add nodes or "
            "resources, lower what set_resources asks for, or wait longer with "
            "env.set_placement(ready_timeout_s=...)"
        )

    def actor_options(self, key: SubtaskKey, in_group: bool = True) -> dict[str, Any]:
        """Resource and scheduling options for the actor of subtask ``key``."""
        options = dict(self.plan.requests.get(key[0], {}))
        if in_group and self.enabled and self.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.group,
                placement_group_bundle_index=self.plan.bundle_of[key],
                placement_group_capture_child_tasks=False,
            )
        return options

    async def remove(self) -> None:
        """Remove the group (its bundles' resources go back to the cluster)."""
        group, self.group = self.group, None
        self._removed = True
        if group is None:
            return
        from ray.util.placement_group import remove_placement_group

        try:
            await asyncio.to_thread(remove_placement_group, group)
        except Exception as exc:  # noqa: BLE001 - gone already; Ray removes it with us
            log.debug("removing placement group %s: %s", self.name, exc)


def job_placement_groups(job_id: str) -> dict[str, str]:
    """Placement groups of a job's job masters that Ray still holds: id (hex) -> state."""
    from ray.util.placement_group import placement_group_table

    prefix = f"rayflow:{job_id}:pg:"
    return {
        pg_id: info["state"]
        for pg_id, info in placement_group_table().items()
        if str(info.get("name", "")).startswith(prefix) and info.get("state") != "REMOVED"
    }


def remove_job_placement_groups(job_id: str) -> int:
    """Remove every placement group of a job's job masters (a job master that died leaves
    its group while the driver lives); returns how many were removed."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed = 0
    try:
        groups = job_placement_groups(job_id)
    except Exception as exc:  # noqa: BLE001 - GCS unreachable: Ray removes them with the job
        log.warning("listing placement groups of job %s: %s", job_id, exc)
        return 0
    for pg_id in groups:
        try:
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            removed += 1
        except Exception as exc:  # noqa: BLE001 - removed meanwhile
            log.debug("removing placement group %s: %s", pg_id, exc)
    return removed
