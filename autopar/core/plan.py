"""`ParallelPlan`: plain data describing a parallel execution plan; JSON round-trip.

A plan holds everything needed to lower a traced step again without searching (the spec of
every input, output and constrained intermediate) and everything needed to explain it (the
strategy per heavy operator with its source line, predicted costs, ILP statistics, fallbacks).

Example:
    >>> text = plan.to_json()
    >>> same = autopar.ParallelPlan.from_json(text)
    >>> step = autopar.parallelize(train_step, mesh=mesh, plan=same)   # skips the search
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.core import _compat
from autopar.core.graph import OpGraph, TensorKind
from autopar.core.options import ManualStageOption
from autopar.core.plan_check import check_specs, converted, plan_data, required_keys
from autopar.core.spec import Spec

PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorPlan:
    """Sharding of one flat argument or result leaf."""
    index: int
    path: str
    role: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    stage: int = 0            # pipeline plans: the stage whose submesh holds the leaf


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorPlan:
    """The strategy chosen for one heavy operator (matmul, convolution, embedding)."""
    node: int
    primitive: str
    strategy: str
    communication: str
    source: str
    name_stack: str
    out_shape: tuple[int, ...]
    out_spec: Spec
    flops: float
    compute_s: float                   # over all its runs (x `trips`)
    comm_s: float
    trips: int = 1                     # runs per step: inside a loop body, its trip count


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectivePlan:
    """A collective the plan expects XLA to insert (XLA may combine independent ones): a
    strategy's (`tensor` its result) or a resharding step's (`tensor` moves from `src` to `dst`
    for operand `operand` of node `node`; node -1: for result position `operand`)."""
    node: int
    primitive: str
    kind: str                 # "all-reduce", "all-gather", "all-to-all", ...
    detail: str               # e.g. "all-reduce(model) 32.0 KiB"
    name_stack: str
    source: str
    comm_s: float
    tensor: int = -1
    operand: int = -1
    nbytes: float = 0.0       # per device: the result (all-reduce, all-gather), the input
                              # (reduce-scatter), the bytes held (all-to-all, permute)
    axes: tuple[str, ...] = ()
    src: Spec = ()
    dst: Spec = ()

    @property
    def is_reshard(self) -> bool:
        """A resharding step's collective (its detail names " reshard "), not a strategy's."""
        return " reshard " in self.detail

    @property
    def algorithm(self) -> str:
        """The algorithm the cost model priced ("ring", "butterfly", ...), the detail's last
        word (e.g. "all-reduce(data) 4 B ring"); "-" when not named (a resharding step's)."""
        parts = self.detail.split(" ")
        return parts[3] if len(parts) == 4 and not self.is_reshard else "-"


@dataclass(frozen=True, slots=True, kw_only=True)
class FallbackPlan:
    node: int
    primitive: str
    source: str
    reason: str
    replicated_bytes: int = 0     # whole non-scalar operands and results each device holds


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlan:
    """One pipeline stage: its devices, logical mesh and predicted costs. A ShardParallel plan
    has a single stage covering the whole mesh."""
    index: int
    device_ids: tuple[int, ...]
    logical_mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    compute_s: float
    comm_s: float
    reshard_s: float
    peak_memory_bytes: float                   # a pipeline stage's: with optimizer state,
                                               # accumulator and in-flight activations
    # Pipeline stages only:
    layers: tuple[int, int] = (0, 0)           # first and last layer
    submesh: tuple[int, ...] = ()              # (hosts, devices per host)
    latency_s: float = 0.0                     # forward + backward of one microbatch
    activation_bytes: float = 0.0              # per device, per in-flight microbatch
    scopes: tuple[str, ...] = ()               # model code in the stage (name scopes)
    remat: str = "none"                        # what its layers keep for the backward (Remat)
    zero: bool = False                         # optimizer state split over its data axis
    activation_bytes_without_remat: float | None = None   # the same, recomputing nothing
                                               # (the stage search's estimate; None: unpriced)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    version: int = PLAN_FORMAT_VERSION
    method: str
    cluster: str                               # ClusterSpec name the costs were computed for
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device_ids: tuple[int, ...]
    graph_fingerprint: str
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    constraints: tuple[tuple[int, Spec], ...]  # (tensor id, spec) of constrained intermediates
    operators: tuple[OperatorPlan, ...]
    collectives: tuple[CollectivePlan, ...] = ()
    # (node, operand, spec): the lowering reshards operand `operand` of node `node` (node -1:
    # result position `operand`) into `spec` through constrained intermediate layouts.
    reshards: tuple[tuple[int, int, Spec], ...] = ()
    fallbacks: tuple[FallbackPlan, ...]
    stages: tuple[StagePlan, ...]
    predicted_compute_s: float
    predicted_comm_s: float
    predicted_reshard_s: float
    peak_memory_bytes: float
    predicted_overhead_s: float = 0.0          # fixed cost of the step's executable calls
    memory_budget_bytes: float
    ilp: dict = field(default_factory=dict)    # IlpStats as a dict
    timings_s: dict = field(default_factory=dict)
    pipeline: dict = field(default_factory=dict)  # schedule, microbatches, layers, DP stats
    remat: dict = field(default_factory=dict)  # single mesh: the loss's layer boundaries and
                                               # per-layer Remat choices, and the fingerprint
                                               # of the step traced with them (empty: none)
    measured: dict = field(default_factory=dict)  # from autopar.calibrate: step_s, peak_bytes
    origin: str = "search"   # "search", "plan cache", "saved plan", or "process 0 (...)"
    # Pipeline plans: each stage's ILP solution as JSON data (`inter_op.stage_solve.
    # solution_record`), so that a saved or cached plan replays its stages without solving.
    stage_solutions: tuple[dict, ...] = ()
    # When the search that produced this plan ran (ISO 8601, UTC; "" for hand-built plans). A
    # plan from the plan cache or a file keeps it, with its `timings_s` and `ilp` record.
    searched_at: str = ""
    # "Why this plan": the runner-ups the search priced under the same cost model, best first,
    # each {"name", "kind" ("method" | "stage layout"), "predicted_step_s",
    # "peak_memory_bytes", "fits" (within memory_budget_bytes), "note"}.
    alternatives: tuple[dict, ...] = ()

    def stage_option(self):
        """The `ManualStageOption` that replays this plan's stages (pipeline plans)."""
        return ManualStageOption(layer_spans=tuple(s.layers for s in self.stages),
                                 submesh_shapes=tuple(s.submesh for s in self.stages),
                                 logical_shapes=tuple(s.logical_mesh_shape for s in self.stages),
                                 remat=tuple(s.remat for s in self.stages),
                                 zero=tuple(s.zero for s in self.stages))

    @property
    def is_pipeline(self) -> bool:
        """A real pipeline (stages on submeshes), not one-mesh gradient accumulation (whose
        `pipeline` record is also set) nor a one-mesh plan."""
        return bool(self.pipeline) and not self.pipeline.get("gradient_accumulation")

    def stage_parts(self, stage: int | None
                    ) -> tuple[tuple[OperatorPlan, ...], tuple[CollectivePlan, ...]]:
        """The heavy operators and predicted collectives of a pipeline plan's stage (from its
        saved solution, one microbatch's forward + backward), or of a one-mesh plan (None).

            >>> ops, colls = plan.stage_parts(0)
        """
        if stage is None:
            return self.operators, self.collectives
        rec = self.stage_solutions[stage] if stage < len(self.stage_solutions) else {}
        return (tuple(_operator_plan(o) for o in rec.get("operators", ())),
                tuple(_collective_plan(c) for c in rec.get("collectives", ())))

    def stage_solution(self, stage: int) -> StageSolution:
        """Pipeline stage `stage`'s saved ILP solution, loaded from `stage_solutions`."""
        return solution_from_record(self.stage_solutions[stage])[1]

    @property
    def predicted_step_s(self) -> float:
        return (self.predicted_compute_s + self.predicted_comm_s + self.predicted_reshard_s
                + self.predicted_overhead_s)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(dataclasses.asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> ParallelPlan:
        """The plan `to_json` wrote. Raises InvalidArgumentError for text that is not a
        plan (not JSON, truncated, missing keys, malformed entries) and PlanMismatchError for
        another format version or specs that do not fit the plan's mesh (`plan_check`)."""
        d = plan_data(text, PLAN_FORMAT_VERSION, required_keys(cls))
        spec = spec_from_json
        conv = {
            "inputs": lambda v: tuple(_tensor_plan(t) for t in v),
            "outputs": lambda v: tuple(_tensor_plan(t) for t in v),
            "constraints": lambda v: tuple((int(t), spec(s)) for t, s in v),
            "operators": lambda v: tuple(_operator_plan(o) for o in v),
            "collectives": lambda v: tuple(_collective_plan(c) for c in v),
            "reshards": lambda v: tuple((int(n), int(i), spec(s)) for n, i, s in v),
            "fallbacks": lambda v: tuple(FallbackPlan(**f) for f in v),
            "stages": lambda v: tuple(StagePlan(**{**s, **{k: tuple(s[k]) for k in (
                "device_ids", "logical_mesh_shape", "axis_names", "layers", "submesh",
                "scopes") if k in s}}) for s in v),
            **{k: lambda v: tuple(int(x) for x in v) for k in ("mesh_shape", "device_ids")},
            "axis_names": lambda v: tuple(str(x) for x in v),
            "stage_solutions": tuple,
            "alternatives": tuple,
        }
        for key, convert in conv.items():
            if key in d:
                d[key] = converted(key, d[key], convert)
        plan = converted("(the plan)", d, lambda v: cls(**v))
        check_specs(plan)
        return plan


def stamped(plan: ParallelPlan) -> ParallelPlan:
    """`plan` with `searched_at` set to now (UTC) where its search left it unset."""
    if plan.searched_at:
        return plan
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return dataclasses.replace(plan, searched_at=now)


def spec_from_json(value: Any) -> Spec:
    """A spec read back from JSON (lists) as the tuples `Spec` is."""
    return tuple(tuple(int(a) for a in dim) for dim in value)


def _operator_plan(d: dict) -> OperatorPlan:
    """An OperatorPlan read back from JSON (lists as tuples)."""
    return OperatorPlan(**{**d, "out_shape": tuple(d["out_shape"]),
                           "out_spec": spec_from_json(d["out_spec"])})


def _collective_plan(d: dict) -> CollectivePlan:
    """A CollectivePlan read back from JSON (plans saved before `src`/`dst`/`axes` existed
    keep their defaults)."""
    d = {**d, **{k: spec_from_json(d[k]) for k in ("src", "dst") if k in d}}
    return CollectivePlan(**{**d, "axes": tuple(d.get("axes", ()))})


def _tensor_plan(d: dict) -> TensorPlan:
    return TensorPlan(**{**d, "shape": tuple(d["shape"]), "spec": spec_from_json(d["spec"])})


_SIMPLE = (int, float, bool, str, type(None), enum.Enum)


@dataclass(slots=True)
class _Seen:
    """What one fingerprint has already digested: jaxpr objects (by id, kept alive so the id
    is not reused) and the text of each abstract value type."""
    jaxprs: dict = field(default_factory=dict)
    avals: dict = field(default_factory=dict)


def _stable(value: Any, memo: _Seen) -> str:
    """A repr that is the same in every process for plain parameter values (axes, dimension
    numbers, dtypes) and for sub-jaxprs (scan/cond/while bodies, the loss of a kept gradient,
    see `_jaxpr_digest`); other values (callables, shardings) count by type only."""
    if isinstance(value, _SIMPLE):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_stable(v, memo) for v in value) + ")"
    if isinstance(value, (_compat.ClosedJaxpr, _compat.Jaxpr)):
        return _jaxpr_digest(value, memo)
    if hasattr(value, "_fields"):   # NamedTuple-like dimension numbers
        return type(value).__name__ + _stable(tuple(value), memo)
    if hasattr(value, "itemsize") and hasattr(value, "name"):   # numpy dtypes
        return str(value)
    return type(value).__name__


def _jaxpr_digest(jaxpr, memo: _Seen) -> str:
    """A digest of a (closed) jaxpr: its constants' and inputs' types, every equation's
    primitive, plain parameters (sub-jaxprs recursively) and output types, literal values,
    and which values each equation reads (variables numbered by definition order, so no
    object identity enters). A body shared by many equations is read once per fingerprint."""
    hit = memo.jaxprs.get(id(jaxpr))
    if hit is not None:
        return hit[1]
    closed = isinstance(jaxpr, _compat.ClosedJaxpr)
    inner = jaxpr.jaxpr if closed else jaxpr
    number: dict = {}
    parts = ["closed" if closed else "open"]
    avals = memo.avals

    def aval_text(aval) -> str:      # avals compare by value (shape, dtype, weak type, ...)
        try:
            return avals[aval]
        except KeyError:
            text = avals[aval] = str(aval) + ("~" if getattr(aval, "weak_type", False) else "")
            return text
        except TypeError:            # an unhashable abstract value
            return str(aval)

    def define(v) -> str:
        number[v] = len(number)
        return aval_text(v.aval)

    def read(atom) -> str:
        if isinstance(atom, _compat.Literal):
            val = atom.val
            val = repr(val) if isinstance(val, (bool, int, float, complex)) else \
                np.asarray(val).tobytes().hex()
            return f"{val}:{aval_text(atom.aval)}"
        return str(number[atom])

    parts.append("const " + ",".join(define(v) for v in inner.constvars))
    parts.append("in " + ",".join(define(v) for v in inner.invars))
    for eqn in inner.eqns:
        params = ",".join(f"{k}={_stable(v, memo)}" for k, v in sorted(eqn.params.items()))
        ins = ",".join(read(a) for a in eqn.invars)
        outs = ",".join(define(v) for v in eqn.outvars)
        parts.append(f"{eqn.primitive.name}[{params}]({ins})->{outs}")
    parts.append("out " + ",".join(read(a) for a in inner.outvars))
    digest = hashlib.sha256(";".join(parts).encode()).hexdigest()[:32]
    memo.jaxprs[id(jaxpr)] = (jaxpr, digest)
    return digest


def graph_fingerprint(graph: OpGraph) -> str:
    """Identifies a traced step: primitives, their parameters (sub-jaxprs such as loop bodies
    and a kept gradient's loss included), shapes and dtypes of every node and input. The same
    in every process and run.

    Example:
        >>> graph_fingerprint(trace(lambda x: jnp.tanh(x), (jnp.ones((4, 4)),)))
        '...'        # 16 hex digits
    """
    h = hashlib.sha256()
    memo = _Seen()
    for tid in graph.inputs:
        t = graph.tensors[tid]
        h.update(f"{t.shape}{t.dtype};".encode())
    for tid, value in graph.const_values.items():   # literals (loop bodies are inlined)
        if graph.tensors[tid].rank == 0:
            h.update(f"c{tid}={_scalar(value, graph.tensors[tid].dtype)};".encode())
    for node in graph.nodes:
        outs = ",".join(f"{graph.tensors[o].shape}{graph.tensors[o].dtype}" for o in node.outputs)
        params = ",".join(f"{k}={_stable(v, memo)}" for k, v in sorted(node.eqn.params.items()))
        h.update(f"{node.primitive}[{params}]({','.join(map(str, node.inputs))})->{outs};"
                 .encode())
    return h.hexdigest()[:16]


def _scalar(value, dtype: str) -> str:
    """A scalar constant's bytes in its tensor's dtype (a literal is a Python number, a
    numpy scalar or a typed one: the same value must give the same text)."""
    try:
        return np.asarray(value, dtype=dtype).tobytes().hex()
    except (TypeError, ValueError):      # a PRNG key, a token: counted by type only
        return type(value).__name__


def constrained_tensors(graph: OpGraph, constant: Collection[int]) -> list[int]:
    """Intermediates whose sharding the lowering pins: every non-scalar value except those
    computed from constants alone (XLA materializes those where they are needed)."""
    return [t.id for t in graph.tensors
            if t.kind == TensorKind.INTERMEDIATE and t.rank > 0 and t.id not in constant]


# ------------------------------------------------ ILP and stage solutions (plain data)
@dataclass(frozen=True, slots=True, kw_only=True)
class IlpStats:
    num_groups: int              # strategy variables before presolve
    num_edges: int
    num_memory_points: int
    num_variables: int           # of the model the solver saw
    num_constraints: int
    build_time_s: float
    solve_time_s: float
    status: str                  # SolveStatus value
    backend: str
    message: str
    objective_s: float
    layer_reuse: str = ""        # e.g. "12 x block_* solved once (period 2), 1788 ties"
    peak_bytes: float = 0.0      # the chosen plan's peak as the ILP's memory points count it


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSolution:
    """The ILP's plan of one stage on one logical mesh (specs are per input group, in order)."""
    logical_shape: tuple[int, ...]
    latency_s: float             # forward + backward of one microbatch (with their call overhead)
    overhead_s: float = 0.0      # the fixed cost of those two executable calls
    compute_s: float
    comm_s: float
    reshard_s: float
    peak_memory_bytes: float     # per device, one microbatch in flight
    activation_bytes: float      # per device, kept per in-flight microbatch (vjp residuals)
    param_bytes: float           # per device
    grad_bytes: float = 0.0      # per device: its parameters' gradients (the graph's outputs)
    weight_bytes: float = 0.0    # per device: what a microbatch keeps from its B to its W
                                 # where the backward is split (`stage_solve._weight_bytes`)
    trains: bool = True          # False: a forward-only stage (no gradient accumulator, no
                                 # optimizer state, nothing kept for a backward)
    deferred_bytes: float = 0.0  # per device: temporaries its weight-gradient tail reads,
                                 # live from its backward to the end (`deferred_bytes`)
    param_specs: tuple[Spec, ...]
    data_specs: tuple[Spec, ...]
    act_specs: tuple[Spec, ...]  # float acts then int acts (as StageIO orders them)
    out_specs: tuple[Spec, ...]  # float outputs then int outputs
    grad_specs: tuple[Spec, ...]
    constraints: tuple[tuple[int, Spec], ...] = ()   # (stage-graph tensor, spec) pinned inside
    # (node, operand, spec): operands the lowering moves into another layout through
    # constrained intermediate layouts (node -1: a result position), as `ParallelPlan.reshards`
    reshards: tuple[tuple[int, int, Spec], ...] = ()
    ilp: IlpStats
    # ZeRO on this stage (its optimizer state split over the data axis, axis 0): the
    # parameter bytes per device whose state it splits, and the all-gather of the updated
    # parameters it then costs once per step.
    zero_split_bytes: float = 0.0
    zero_gather_s: float = 0.0
    # For the dump: the stage's heavy operators and predicted collectives (one microbatch's
    # forward + backward), as a one-mesh plan lists them.
    operators: tuple[OperatorPlan, ...] = ()
    collectives: tuple[CollectivePlan, ...] = ()

    def optimizer_bytes(self, opt_ratio: float, zero: bool = False) -> float:
        """Per device: the optimizer state (`opt_ratio` bytes per parameter byte), with ZeRO
        split over the data axis."""
        d = self.logical_shape[0]
        saved = self.zero_split_bytes * (1 - 1 / d) if zero else 0.0
        return opt_ratio * (self.param_bytes - saved)


def solution_record(sol: StageSolution, graph_fp: str) -> dict:
    """`sol` as JSON data for a `ParallelPlan`, with the fingerprint of the stage graph its
    tensor ids refer to: a saved or cached pipeline plan replays its stages without an ILP."""
    return json.loads(json.dumps({"graph_fingerprint": graph_fp, **dataclasses.asdict(sol)}))


def solution_from_record(record: dict) -> tuple[str, StageSolution]:
    """(stage graph fingerprint, solution) from `solution_record`'s data."""
    d = dict(record)
    fp = d.pop("graph_fingerprint")
    specs = lambda v: tuple(spec_from_json(s) for s in v)
    for k in ("param_specs", "data_specs", "act_specs", "out_specs", "grad_specs"):
        d[k] = specs(d[k])
    d["logical_shape"] = tuple(d["logical_shape"])
    d["constraints"] = tuple((int(t), spec_from_json(s)) for t, s in d["constraints"])
    d["reshards"] = tuple((int(n), int(i), spec_from_json(s))
                          for n, i, s in d.get("reshards", ()))
    d["ilp"] = IlpStats(**d["ilp"])
    d["operators"] = tuple(_operator_plan(o) for o in d.get("operators", ()))
    d["collectives"] = tuple(_collective_plan(c) for c in d.get("collectives", ()))
    return fp, StageSolution(**d)


def alternative_record(name: str, kind: str, step_s: float | None, peak_bytes: float, budget: float,
           note: str) -> dict:
    """One `ParallelPlan.alternatives` entry."""
    return {"name": name, "kind": kind,
            "predicted_step_s": None if step_s is None else float(step_s),
            "peak_memory_bytes": float(peak_bytes),
            "fits": step_s is not None and peak_bytes <= budget * (1 + 1e-9), "note": note}
