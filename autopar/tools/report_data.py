"""The numbers `autopar.report` shows, read off a `ParallelPlan`: memory per stage broken into
the parts the plan records, and collectives grouped by kind and mesh axes. Pure functions of
the plan (no JAX).

Example:
    >>> bars, notes = memory_bars(plan)
    >>> [(name, int(n)) for name, n in bars[0].parts]        # doctest: +SKIP
    [('parameters', 8448), ('optimizer state', 16896), ...]
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.core.plan import CollectivePlan, ParallelPlan, TensorPlan
from autopar.core.spec import num_shards
from autopar.inter_op.stage_costs import working_bytes
from autopar.tools.report_svg import MemoryBar

ROLE_PARTS = (("param", "parameters"), ("opt_state", "optimizer state"), ("batch", "batch"),
              ("other", "other inputs"))
REST = "activations, gradients, results and temporaries"
UNATTRIBUTED = "not attributed"


def leaf_bytes(t: TensorPlan) -> float:
    """The whole leaf's bytes (all devices together)."""
    itemsize = np.dtype(t.dtype).itemsize if t.dtype not in ("key", "token") else 8
    return float(math.prod(t.shape)) * itemsize


def device_bytes(t: TensorPlan, mesh_shape) -> float:
    """The bytes of leaf `t` one device holds under its spec on `mesh_shape`."""
    return leaf_bytes(t) / num_shards(t.spec, mesh_shape)


def optimizer_ratio(plan: ParallelPlan) -> float:
    """Optimizer-state bytes per parameter byte (Adam: 2), as the stage search sizes it."""
    params = sum(leaf_bytes(t) for t in plan.inputs if t.role == "param")
    return sum(leaf_bytes(t) for t in plan.inputs if t.role == "opt_state") / max(params, 1.0)


def memory_bars(plan: ParallelPlan) -> tuple[list[MemoryBar], list[str]]:
    """One bar per pipeline stage (one for a single-mesh plan) and notes on what the plan
    does not break down. Every bar's parts sum to its predicted peak."""
    if plan.pipeline and plan.stage_solutions:
        return _stage_bars(plan)
    return _single_bar(plan)


def _closing(parts: list[tuple[str, float]], peak: float, label: str,
             notes: list[str]) -> list[tuple[str, float]]:
    """`parts` plus a remainder up to `peak` (noted when the parts overshoot it)."""
    rest = peak - sum(n for _, n in parts)
    if rest > 0.5:
        parts.append((UNATTRIBUTED, rest))
    elif rest < -0.5:
        notes.append(f"{label}: the recorded parts add up to {-rest:.0f} B more than the "
                     "predicted peak (they are not all live at the same time).")
    return parts


def _single_bar(plan: ParallelPlan) -> tuple[list[MemoryBar], list[str]]:
    notes = ["The step's arguments are broken down by role from the input shardings; the rest "
             "of the predicted peak (activations, gradients, results, temporaries) is one "
             "number in the plan, not broken down further."]
    parts = []
    for role, name in ROLE_PARTS:
        n = sum(device_bytes(t, plan.mesh_shape) for t in plan.inputs if t.role == role)
        if n:
            parts.append((name, n))
    rest = plan.peak_memory_bytes - sum(n for _, n in parts)
    if rest > 0.5:
        parts.append((REST, rest))
    elif rest < -0.5:
        notes.append("The arguments add up to more than the predicted peak: the memory model "
                     "counts a donated argument's buffer once, with its result.")
    if plan.remat:
        notes.append("Rematerialization per layer: " + ", ".join(plan.remat.get("layers", ()))
                     + "; the plan does not record the bytes it saves.")
    return [MemoryBar("whole mesh", tuple(parts), plan.peak_memory_bytes,
                      plan.measured.get("compiled_bytes"))], notes


def _stage_bars(plan: ParallelPlan) -> tuple[list[MemoryBar], list[str]]:
    """A stage's peak as the stage search counts it (`inter_op.stage_costs.static_bytes` plus
    the in-flight activations): parameters, the gradient accumulator (one parameter's worth),
    one microbatch's gradients, optimizer state (split over the data axis with ZeRO), working
    memory, the activations of the microbatches in flight and W's part of those deferred at
    the stage's peak (`pipeline["kept_at_peak"]`), and the results of the other microbatches
    it keeps until they combine (`pipeline["result_bytes"]`)."""
    ratio = optimizer_ratio(plan)
    in_flight = plan.pipeline.get("in_flight") or [1] * len(plan.stages)
    n, m = len(plan.stages), plan.pipeline.get("num_microbatches", 1)
    kept = plan.pipeline.get("kept_at_peak") or [[q, 0] for q in in_flight]
    results = plan.pipeline.get("result_bytes") or [0.0] * n
    compiled = plan.measured.get("compiled_stage_bytes") or [None] * len(plan.stages)
    notes = [f"Parts from each stage's recorded ILP solution; optimizer state is "
             f"{ratio:.2f} bytes per parameter byte (from the inputs' roles)."]
    saves = [_remat_saves(st, q) for st, q in zip(plan.stages, in_flight)]
    if any(v for v in saves):
        notes.append("Outlined past a bar: the in-flight activations its recomputation saves "
                     "(what its layers would keep without it, the stage search's sum of their "
                     "fastest plans, minus what they keep).")
    if any(v is None for v in saves):
        notes.append("A stage with recomputation whose savings the search did not price "
                     "(recomputation forced, or a manual layout) names its mode only.")
    bars = []
    stages = zip(plan.stages, kept, results, compiled, saves)
    for k, (st, (q, d), r, c, sv) in enumerate(stages):
        sol = plan.stage_solution(k)
        label = f"stage {st.index}"
        trains = sol.trains          # a forward-only stage has neither of the next two
        parts = [("parameters", sol.param_bytes),
                 ("gradient accumulator", sol.param_bytes if trains else 0.0),
                 ("gradients (one microbatch)", sol.grad_bytes),
                 ("optimizer state", sol.optimizer_bytes(ratio, st.zero) if trains else 0.0),
                 ("working memory", working_bytes(sol)),
                 ("activations in flight", q * st.activation_bytes),
                 ("deferred weight gradients", d * sol.weight_bytes),
                 ("results of the other microbatches", (m - 1) * r)]
        parts = _closing([p for p in parts if p[1] > 0], st.peak_memory_bytes, label, notes)
        bars.append(MemoryBar(f"{label} \u00b7 remat {st.remat}" + (" + zero" if st.zero else ""),
                              tuple(parts), st.peak_memory_bytes, c, saved=sv or 0.0))
    return bars, notes


def _remat_saves(st, in_flight: int) -> float | None:
    """Bytes per device a stage's recomputation saves (0 without any; None: not priced)."""
    if st.remat == "none":
        return 0.0
    if st.activation_bytes_without_remat is None:
        return None
    return max(0.0, in_flight * (st.activation_bytes_without_remat - st.activation_bytes))


# ---------------------------------------------------------------------- collectives
@dataclass(frozen=True, slots=True)
class CollectiveGroup:
    stage: int | None      # pipeline stage (its collectives per microbatch); None: one mesh
    kind: str
    axes: tuple[str, ...]
    algorithm: str
    origin: str            # "strategy" (an operator's) or "resharding"
    count: int
    nbytes: float
    comm_s: float


def collective_groups(plan: ParallelPlan) -> list[CollectiveGroup]:
    """The plan's collectives grouped by kind, mesh axes, algorithm and origin (and stage,
    for a pipeline: each stage's one microbatch forward + backward, from its saved solution),
    the most predicted time first."""
    stages = range(len(plan.stage_solutions)) if plan.stage_solutions else [None]
    groups: dict[tuple, list[CollectivePlan]] = {}
    for stage in stages:
        for c in plan.stage_parts(stage)[1]:
            origin = "resharding" if c.is_reshard else "strategy"
            groups.setdefault((stage, c.kind, tuple(c.axes), c.algorithm, origin),
                              []).append(c)
    out = [CollectiveGroup(st, k, a, alg, o, len(cs), sum(c.nbytes for c in cs),
                           sum(c.comm_s for c in cs))
           for (st, k, a, alg, o), cs in groups.items()]
    return sorted(out, key=lambda g: (-g.comm_s, g.kind))
