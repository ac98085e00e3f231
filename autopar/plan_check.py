"""Checks of a plan read back from JSON (`ParallelPlan.from_json`): the text is JSON, is a
plan of this format, has every key, and its input and output specs fit its mesh (each names
an axis the mesh has, at most once, and splits only dimensions its axes' size divides). A
file that was cut short, edited by hand or written for another mesh fails here, naming the
key or tensor and the fix, instead of deep inside the lowering.

Example:
    >>> data = plan_data(text)                 # the JSON object, or InvalidArgumentError
    >>> plan = ParallelPlan(**converted(data))
    >>> check_specs(plan)                      # PlanMismatchError naming the tensor
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

from .errors import InvalidArgumentError, PlanMismatchError
from .frontend.checks import short_repr

_FIX = "Fix: pass the whole text plan.to_json() wrote, or re-plan (parallelize without plan=)."


def plan_data(text: Any, version: int, required: tuple[str, ...]) -> dict:
    """The JSON object of a plan, checked: text, valid JSON, an object, this format version,
    every required key."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise InvalidArgumentError(
            f"ParallelPlan.from_json: got a {type(text).__name__}, not the JSON text of a plan. "
            f"Fix: pass the string plan.to_json() returns (e.g. open(path).read()).")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(
            f"ParallelPlan.from_json: the text ({len(text)} characters) is not valid JSON: "
            f"{e.msg} at line {e.lineno} column {e.colno} (the file may be truncated or not a "
            f"plan). {_FIX}") from None
    if not isinstance(data, dict):
        raise InvalidArgumentError(
            f"ParallelPlan.from_json: the JSON is a {type(data).__name__} "
            f"({short_repr(data)}), not a plan (a JSON object with keys such as 'method', "
            f"'mesh_shape', 'inputs'). {_FIX}")
    if data.get("version") != version:
        raise PlanMismatchError(
            f"ParallelPlan.from_json: plan format version {data.get('version')!r} is not the "
            f"supported version {version}"
            f"{' (no version key: this is not a plan)' if 'version' not in data else ''}. "
            f"Fix: re-plan with this autopar version (parallelize without plan=).")
    missing = [k for k in required if k not in data]
    if missing:
        raise InvalidArgumentError(
            f"ParallelPlan.from_json: the plan lacks the key(s) {missing} (it has "
            f"{sorted(data)[:8]}{' ...' if len(data) > 8 else ''}). {_FIX}")
    return data


def required_keys(cls) -> tuple[str, ...]:
    """The fields of dataclass `cls` that have no default."""
    return tuple(f.name for f in dataclasses.fields(cls)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def converted(key: str, value: Any, convert: Callable[[Any], Any]) -> Any:
    """`convert(value)`; a malformed entry (wrong type, a missing or unknown field) is
    reported with its key."""
    try:
        return convert(value)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise InvalidArgumentError(
            f"ParallelPlan.from_json: key {key!r} is malformed ({type(e).__name__}: {e}); "
            f"value {short_repr(value)}. {_FIX}") from None


def check_specs(plan) -> None:
    """Every input and output spec of `plan` fits the mesh of its stage: mesh axes that
    exist, each used once, dimensions divisible by the product of their axes' sizes."""
    for kind in ("inputs", "outputs"):
        for t in getattr(plan, kind):
            mesh_shape = plan.mesh_shape
            if len(plan.stages) > 1 and 0 <= t.stage < len(plan.stages):
                mesh_shape = plan.stages[t.stage].logical_mesh_shape
            _check_spec(f"{kind}[{t.index}] ({t.path}, shape {tuple(t.shape)})", t.spec,
                        tuple(t.shape), tuple(mesh_shape), plan.axis_names)


def _check_spec(where: str, spec, shape: tuple, mesh_shape: tuple, axis_names) -> None:
    fix = ("Fix: re-plan for this mesh (parallelize without plan=), or correct the spec in the "
           "JSON.")
    if len(spec) > len(shape):
        raise PlanMismatchError(f"ParallelPlan.from_json: {where} has a spec of {len(spec)} "
                                f"dimensions for a rank-{len(shape)} tensor. {fix}")
    used = [a for dim in spec for a in dim]
    for a in used:
        if not 0 <= a < len(mesh_shape):
            raise PlanMismatchError(
                f"ParallelPlan.from_json: {where} is split over mesh axis {a}, but the plan's "
                f"mesh {tuple(mesh_shape)} (axes {tuple(axis_names)}) has axes 0.."
                f"{len(mesh_shape) - 1} only. {fix}")
    if len(set(used)) != len(used):
        raise PlanMismatchError(
            f"ParallelPlan.from_json: {where} uses a mesh axis twice in spec {spec}. {fix}")
    for d, dim in enumerate(spec):
        ways = math.prod(mesh_shape[a] for a in dim)
        if shape[d] % ways:
            raise PlanMismatchError(
                f"ParallelPlan.from_json: {where} splits dimension {d} (size {shape[d]}) "
                f"{ways} ways over mesh axes {[axis_names[a] for a in dim]}, which does not "
                f"divide it. {fix}")
