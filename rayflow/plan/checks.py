"""Checks of a job graph made on the driver before anything deploys.

* :func:`check_picklable`: every source, function and sink must pickle, since each
  subtask gets its own copy; when one does not, the error names the operator and the
  captured variable, global or attribute that fails (found by walking closures, the
  globals a function uses, attributes and containers), with what to do instead.
* :func:`check_aggregations`: a built-in aggregation (``sum``, ``min``, ``max``) whose
  input schema is known from its source (a collection, a number sequence) is checked
  against the field's type here rather than when its first batch arrives.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from rayflow.errors import NotPicklableError
from rayflow.plan.physical import JobGraph, OperatorSpec, VertexSpec

__all__ = ["check_picklable", "check_aggregations"]

#: How deep the search for the object that fails to pickle goes.
MAX_DEPTH = 8

HINT = (
    "Create it in open() of a rayflow Function (MapFunction, FlatMapFunction, "
    "ReduceFunction, KeyedProcessFunction...; open() runs in each subtask), or inside the "
    "function, instead of capturing it."
)


# --- picklability -------------------------------------------------------------------------


class _Discard:
    def write(self, data: Any) -> int:
        return len(data)


def _pickle_error(obj: Any) -> BaseException | None:
    """Why ``obj`` cannot be pickled as Ray would pickle it, None when it can. Arrow and
    other out-of-band buffers are not copied; Ray handles are left to Ray."""
    import ray
    from ray import cloudpickle

    handles = (ray.actor.ActorHandle, ray.ObjectRef)

    class Probe(cloudpickle.CloudPickler):
        def persistent_id(self, value: Any) -> Any:
            return id(value) if isinstance(value, handles) else None

    try:
        Probe(_Discard(), protocol=5, buffer_callback=lambda buffer: None).dump(obj)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer
        return exc
    return None


def _global_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _children(obj: Any) -> list[tuple[str, Any]]:
    """What ``obj`` pickles with, each with how to name it in a path."""
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        found: list[tuple[str, Any]] = []
        for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                found.append((f"captured variable {name!r}", cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        seen = set()
        for name in _global_names(code):
            if name in obj.__globals__ and name not in seen:
                seen.add(name)
                found.append((f"global {name!r}", obj.__globals__[name]))
        for i, value in enumerate(obj.__defaults__ or ()):
            found.append((f"default argument {i}", value))
        for name, value in (obj.__kwdefaults__ or {}).items():
            found.append((f"default argument {name!r}", value))
        return found
    if isinstance(obj, types.MethodType):
        return [("self", obj.__self__), (obj.__func__.__name__, obj.__func__)]
    if isinstance(obj, functools.partial):
        return (
            [("partial's function", obj.func)]
            + [(f"[{i}]", a) for i, a in enumerate(obj.args)]
            + [(f"[{k!r}]", v) for k, v in obj.keywords.items()]
        )
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"[{i}]", item) for i, item in enumerate(obj)]
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict) and not isinstance(obj, type):
        return [(f".{name}", value) for name, value in attributes.items()]
    return []


def _find(obj: Any, path: list[str], depth: int, seen: set[int]) -> tuple[list[str], Any]:
    """The deepest object under ``obj`` (which fails to pickle) that fails itself."""
    if depth < MAX_DEPTH:
        for label, child in _children(obj):
            if id(child) in seen:
                continue
            seen.add(id(child))
            if _pickle_error(child) is not None:
                return _find(child, path + [label], depth + 1, seen)
    return path, obj


def _render(path: list[str], top: str) -> str:
    text = ""
    for label in path:
        if label.startswith((".", "[")):
            text += label if text else top + label
        else:
            text = f"{text} -> {label}" if text else label
    return text


def _check(subject: str, top: str, obj: Any) -> None:
    error = _pickle_error(obj)
    if error is None:
        return
    path, culprit = _find(obj, [], 0, {id(obj)})
    reason = f"{type(error).__name__}: {error}"
    if not path:
        raise NotPicklableError(
            f"{subject} cannot be pickled to be sent to its subtasks ({reason}). {HINT}"
        )
    what = _render(path, top)
    kind = type(culprit)
    kind_name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else (f"{kind.__module__}.{kind.__qualname__}")
    )
    raise NotPicklableError(
        f"{subject} cannot be pickled to be sent to its subtasks: {what} (a {kind_name}) "
        f"cannot be pickled ({reason}). {HINT}"
    )


def _user_objects(spec: OperatorSpec) -> list[Any]:
    """What an operator was built with: its function, key selector, sink."""
    return list(getattr(spec.factory, "args", None) or [spec.factory])


def check_picklable(graph: JobGraph) -> None:
    """Raise :class:`~rayflow.errors.NotPicklableError` naming the operator (or source)
    and the captured variable, global or attribute that cannot be pickled."""
    if _pickle_error(graph) is None:
        return
    from rayflow.plan.partitioners import KeySelector
    from rayflow.sink import Sink

    for vertex in graph.vertices.values():
        if vertex.source is not None:
            name = vertex.name.split(" -> ")[0]
            _check(f"source {name!r}", "self", vertex.source)
        for spec in vertex.operators:
            for obj in _user_objects(spec):
                if isinstance(obj, Sink):
                    _check(f"sink {spec.name!r}", "self", obj)
                elif isinstance(obj, KeySelector):
                    _check(f"operator {spec.name!r} (its key)", "key", obj.key)
                else:
                    _check(f"operator {spec.name!r}", "self", obj)
    for edge in graph.edges.values():
        key = edge.partitioner.key
        if key is not None:
            target = graph.vertices[edge.target_vertex]
            name = target.operators[0].name if target.operators else target.name
            _check(f"the key_by key of {name!r}", "key", key.key)
    error = _pickle_error(graph)
    if error is not None:  # not in what the user gave: say what Ray would have said
        raise NotPicklableError(
            f"the job cannot be pickled to be sent to its subtasks: {type(error).__name__}: {error}"
        )


# --- aggregations -------------------------------------------------------------------------


def _known_schema(source: Any) -> pa.Schema | None:
    from rayflow.sources import CollectionSource, NumberSequenceSource

    if isinstance(source, CollectionSource):
        return source.table.schema
    if isinstance(source, NumberSequenceSource):
        return pa.schema([("value", pa.int64())])
    return None


def _input_schemas(graph: JobGraph, vertex: VertexSpec) -> list[pa.Schema] | None:
    """The schemas of the records reaching ``vertex`` when each input is a source whose
    schema is known (with only filters chained to it before the edge leaves), else None."""
    from rayflow.runtime.operators import FilterOperator

    schemas = []
    for edge_id in vertex.in_edges:
        upstream = graph.vertices[graph.edges[edge_id].source_vertex]
        schema = _known_schema(upstream.source) if upstream.is_source else None
        before = upstream.operators[: graph.output_position(edge_id) + 1]
        if schema is None or any(
            getattr(op.factory, "cls", None) is not FilterOperator for op in before
        ):
            return None
        schemas.append(schema)
    return schemas or None


def check_aggregations(graph: JobGraph) -> None:
    """Check the field of every built-in aggregation whose input schema is known."""
    from rayflow.runtime.operators import KeyedAggregateOperator

    for vertex in graph.vertices.values():
        if not vertex.operators:
            continue
        factory = vertex.operators[0].factory
        if getattr(factory, "cls", None) is not KeyedAggregateOperator:
            continue
        schemas = _input_schemas(graph, vertex)
        if schemas is None:
            continue
        _, aggregation, field = factory.args
        for schema in schemas:
            KeyedAggregateOperator.check_field(aggregation, field, schema)
