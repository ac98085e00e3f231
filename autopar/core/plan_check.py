"""Checks of a plan read back from JSON (`ParallelPlan.from_json`): the text is JSON, is a
plan of this format, has every key, and its input and output specs fit its mesh (each names
an axis the mesh has, at most once, and splits only dimensions its axes' size divides). A
file that was cut short, edited by hand or written for another mesh fails here, naming the
key or tensor and the fix, instead of deep inside the lowering.

Example:
    >>> data = plan_data(text)                 # the JSON object, or InvalidArgumentError
    >>> plan = ParallelPlan(**converted(data))
    >>> check_specs(plan)                      # PlanMismatchError naming the tensor
    >>> check_contents(plan)    # ilp, pipeline, ...: InvalidArgumentError naming the key path
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from autopar.core._format import short_repr
from autopar.core.enums import Schedule
from autopar.core.errors import InvalidArgumentError, PlanMismatchError

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
    """The plan's contents are well formed (`check_contents`) and every input and output spec
    fits the mesh of its stage: mesh axes that exist, each used once, dimensions divisible by
    the product of their axes' sizes."""
    check_contents(plan)
    for kind in ("inputs", "outputs"):
        for t in getattr(plan, kind):
            mesh_shape = plan.mesh_shape
            if plan.pipeline and 0 <= t.stage < len(plan.stages):   # its stage's mesh
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


# What `autopar.dump`, `autopar.report` and `autopar.summary` read from a plan's records
# (`tools.dump`, `tools.report`, `report_data`, `report_svg`): key -> kind of value. A record
# that is not empty must have every key (as every search writes them).
_INT, _NUM, _STR, _BOOL, _INTS, _STRS = "an int", "a number", "a string", "a bool", \
    "a list of ints", "a list of strings"
_NUM_OR_NULL, _BOOL_OR_NULL = "a number or null", "a bool or null"
ILP_KEYS = {"num_groups": _INT, "num_edges": _INT, "num_memory_points": _INT,
            "num_variables": _INT, "num_constraints": _INT, "backend": _STR, "status": _STR,
            "build_time_s": _NUM, "solve_time_s": _NUM}
PIPELINE_KEYS = {"schedule": _STR, "num_microbatches": _INT, "num_layers": _INT,
                 "bubble_fraction": _NUM, "in_flight": _INTS, "predicted_latency_s": _NUM,
                 "num_ilps": _INT, "num_reused": _INT, "dp_candidates": _INT,
                 "dp_pruned": _INT, "dp_time_s": _NUM, "segments": _INT,
                 "stage_option": _STR, "layer_option": _STR, "gradient_accumulation": _BOOL}
PIPELINE_OPTIONAL = {"layer_boundaries": _INTS, "num_replayed": _INT, "local_gradients": _INTS,
                     "num_gradients": _INTS, "microbatch_combine": _STRS,
                     "one_executable": _BOOL}
REMAT_KEYS = {"layer_boundaries": _INTS, "layers": _STRS, "graph_fingerprint": _STR}
# A rival the runner-ups had no time to price has neither a step time nor a peak (null).
ALTERNATIVE_KEYS = {"name": _STR, "kind": _STR, "predicted_step_s": _NUM_OR_NULL,
                    "peak_memory_bytes": _NUM_OR_NULL, "fits": _BOOL_OR_NULL, "note": _STR}


def _is(value: Any, kind: str) -> bool:
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    is_num = lambda v: is_int(v) or isinstance(v, float)
    return {_INT: is_int, _BOOL: lambda v: isinstance(v, bool), _NUM: is_num,
            _NUM_OR_NULL: lambda v: v is None or is_num(v),
            _BOOL_OR_NULL: lambda v: v is None or isinstance(v, bool),
            _STR: lambda v: isinstance(v, str),
            _INTS: lambda v: isinstance(v, (list, tuple)) and all(map(is_int, v)),
            _STRS: lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
            }[kind](value)


def _malformed(path: str, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"ParallelPlan.from_json: {path} {problem}. {_FIX}")


def _check_record(name: str, record: Any, required: dict, optional: dict | None = None,
                  ) -> None:
    """`record` (a plan's dict field, or one entry of a list field) has every `required` key,
    and each key it has of `required` or `optional` holds its kind of value."""
    if not isinstance(record, dict):
        raise _malformed(name, f"is {short_repr(record)}, not a JSON object")
    missing = [k for k in required if k not in record]
    if missing:
        raise _malformed(name, f"lacks the key(s) {missing} (it has {sorted(record)[:10]})")
    for key, kind in {**required, **(optional or {})}.items():
        if key in record and not _is(record[key], kind):
            raise _malformed(f"{name}[{key!r}]", f"is {short_repr(record[key])}, not {kind}")


def check_contents(plan) -> None:
    """The plan's mesh, tensors and records hold what the lowering, `autopar.dump` and
    `autopar.report` read: axis names match the mesh, tensor shapes are ints and stages exist,
    and the `ilp`, `pipeline`, `remat`, `alternatives` and `stage_solutions` records have
    their keys with values of the right kind. A malformed one is an InvalidArgumentError
    naming its key path (a mesh that does not fit: PlanMismatchError)."""
    if len(plan.axis_names) != len(plan.mesh_shape):
        raise PlanMismatchError(
            f"ParallelPlan.from_json: axis_names {tuple(plan.axis_names)} has "
            f"{len(plan.axis_names)} name(s) for the {len(plan.mesh_shape)}-D mesh_shape "
            f"{tuple(plan.mesh_shape)}. Fix: give one axis name per mesh dimension, or re-plan "
            f"(parallelize without plan=).")
    _check_tensors(plan)
    _check_records(plan)


def _check_tensors(plan) -> None:
    num_stages = max(len(plan.stages), 1)
    for kind in ("inputs", "outputs"):
        for k, t in enumerate(getattr(plan, kind)):
            where = f"{kind}[{k}] ({short_repr(t.path, 60)})"
            if not all(_is(d, _INT) and d >= 0 for d in t.shape):
                raise _malformed(f"{where}['shape']", f"is {list(t.shape)}: every dimension "
                                 "must be a non-negative int")
            if not _is(t.stage, _INT):
                raise _malformed(f"{where}['stage']", f"is {short_repr(t.stage)}, not an int")
            if not 0 <= t.stage < num_stages:
                raise PlanMismatchError(
                    f"ParallelPlan.from_json: {where}['stage'] is {t.stage}, but the plan has "
                    f"{len(plan.stages)} stage(s) (0..{num_stages - 1}). Fix: re-plan "
                    f"(parallelize without plan=), or correct the stage in the JSON.")


def _check_records(plan) -> None:
    if plan.ilp:
        status = plan.ilp.get("status") if isinstance(plan.ilp, dict) else None
        _check_record("ilp", plan.ilp, {**ILP_KEYS, **(
            {} if status in ("optimal", "trivial") else {"message": _STR})},
            {"layer_reuse": _STR, "num_ilps": _INT})
    if plan.pipeline:
        p = plan.pipeline
        _check_record("pipeline", p, PIPELINE_KEYS, PIPELINE_OPTIONAL)
        if p["schedule"] not in [s.value for s in Schedule]:
            raise _malformed("pipeline['schedule']", f"is {p['schedule']!r}, not one of "
                             f"{[s.value for s in Schedule]}")
        if len(p["in_flight"]) != len(plan.stages):
            raise _malformed("pipeline['in_flight']", f"has {len(p['in_flight'])} entries for "
                             f"{len(plan.stages)} stage(s): it needs one per stage")
    if plan.remat:
        _check_record("remat", plan.remat, REMAT_KEYS)
    for k, a in enumerate(plan.alternatives):
        _check_record(f"alternatives[{k}]", a, ALTERNATIVE_KEYS)
    _check_stage_solutions(plan)


def _check_stage_solutions(plan) -> None:
    for k, record in enumerate(plan.stage_solutions):
        name = f"stage_solutions[{k}]"
        _check_record(name, record, {"graph_fingerprint": _STR})
        try:
            plan.stage_solution(k)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise _malformed(name, f"does not load as a stage solution ({type(e).__name__}: "
                             f"{e})") from None
