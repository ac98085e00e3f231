"""The passes in order for one step: trace -> intra-op ILP -> plan (or the pipeline search),
with the checks between them; `parallelize` (api.py) and `autopar.plan` call these.

Example:
    >>> graph = trace(step, (state, batch), batch_argnums=(1,))
    >>> check_batch(graph)
    >>> plan = plan_graph(graph, cluster, (2, 4), ("data", "model"), ShardParallel(), range(8))
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence

from autopar.core import progress
from autopar.core.collector import no_full_collections
from autopar.core.errors import InvalidArgumentError, PlanMismatchError
from autopar.core.graph import InputRole, OpGraph
from autopar.core.options import PipeshardParallel, ShardParallel
from autopar.core.plan import ParallelPlan, stamped
from autopar.cost.cluster import ClusterSpec, check_cluster
from autopar.cost.model import CostModel
from autopar.frontend.checks import (
    DEFAULT_BATCH_ARGNUMS,
    arg_names,
    argnums_text,
    as_argnums,
    method_instance,
    warn_one_microbatch,
    warn_unmatched_rules,
)
from autopar.frontend.grad import forward_marked
from autopar.frontend.nnx import BoundCall, PureStep
from autopar.frontend.tracer import trace
from autopar.inter_op.pipeline import takes_gradient
from autopar.inter_op.pipeshard import accumulation_method, plan_pipeline
from autopar.inter_op.remat_plan import plan_step, traced_for
from autopar.intra_op import solve_intra_op
from autopar.intra_op.planner import build_plan
from autopar.tools.plan_cache import PlanCache, env_setting
from autopar.tools.runner_ups import with_runner_ups

log = logging.getLogger(__name__)


@progress.timed("intra-op ILP", lambda p: progress.ilp_summary(p.ilp))
def plan_graph(graph: OpGraph, cluster: ClusterSpec, mesh_shape, axis_names, method,
                device_ids, perturb=None, output_pins=None) -> ParallelPlan:
    t0 = time.perf_counter()
    log.info("autopar: traced %d operators (%d tensors) in %.2f s; planning %s on mesh %s",
             len(graph.nodes), len(graph.tensors), graph.trace_time_s, method.kind.value,
             dict(zip(axis_names, mesh_shape)))
    warn_unmatched_rules(method.sharding_rules, [graph.tensors[t].path for t in graph.inputs])
    logical = cluster.logical_mesh(tuple(mesh_shape), tuple(axis_names))
    cost = CostModel(mesh=logical)
    assignment = solve_intra_op(graph, cost, method, graph.carried_outputs, perturb=perturb,
                                output_pins=output_pins)
    ilp = assignment.ilp
    log.info("autopar: intra-op ILP %s: %d variables, %d constraints, built in %.2f s, solved "
             "in %.2f s%s", ilp.status, ilp.num_variables, ilp.num_constraints,
             ilp.build_time_s, ilp.solve_time_s,
             f"; {ilp.layer_reuse}" if ilp.layer_reuse else "")
    budget = method.memory_budget_bytes or logical.memory_bytes
    timings = {"trace": graph.trace_time_s, "intra_op": time.perf_counter() - t0}
    return build_plan(graph, assignment, method=method.kind.value, cluster=cluster.name,
                      device_ids=tuple(device_ids), memory_budget_bytes=budget,
                      timings_s=timings, call_overhead_s=logical.call_overhead_s, cost=cost)


def check_batch(graph: OpGraph, batch_argnums: Sequence[int] = ()) -> None:
    """Every leaf of a batch argument must share one leading (batch) dimension
    (`batch_argnums`: as the user gave them, for the message)."""
    name = argnums_text("batch_argnums", batch_argnums) if batch_argnums else "batch_argnums"
    sizes = {}
    for tid in graph.inputs:
        t = graph.tensors[tid]
        if t.role == InputRole.BATCH:
            if t.rank == 0:
                raise InvalidArgumentError(
                    f"{name}: leaf `{t.path}` is a scalar, so it has no batch dimension. "
                    f"Fix: list only arguments whose leaves are [batch, ...] arrays in "
                    f"batch_argnums (static or scalar arguments belong elsewhere).")
            sizes[t.path] = t.shape[0]
    if len(set(sizes.values())) > 1:
        raise InvalidArgumentError(
            f"{name}: the leaves of the batch argument(s) disagree on the batch "
            f"(leading) dimension: {sizes}. Fix: pass in batch_argnums only arguments whose "
            f"leaves all start with the same batch size.")


def pipelined(method: ShardParallel) -> bool:
    """Pipelines and gradient accumulation run on the pipeline machinery."""
    return isinstance(method, PipeshardParallel) or method.num_microbatches > 1


def pipeline_step(fun: Callable, args: tuple, kw: dict) -> tuple[Callable, OpGraph]:
    """(the function a pipeline plans, its step graph traced with the gradient mark kept):
    `fun` itself where it takes a gradient; a step without one (an eval step, a batched
    forward) is planned as a forward-only pipeline, `fun` with its body marked whole
    (`frontend.grad.forward_marked`). `kw`: `trace`'s argnums."""
    step = trace(fun, args, keep_grad=True, **kw)
    if takes_gradient(step):
        return fun, step
    marked = forward_marked(fun, kw.get("batch_argnums", ()))
    step = trace(marked, args, keep_grad=True, **kw)
    if not takes_gradient(step):       # no mark: every result is an argument or a constant
        raise InvalidArgumentError(
            f"{getattr(fun, '__name__', 'the step')} takes no gradient and computes none of "
            "its results (each is an argument or a constant), so a pipeline has nothing to "
            "run. Fix: compute the results in the step, or use ShardParallel() (or jax.jit).")
    return marked, step


def pipeline_methods(method: ShardParallel, mesh_shape, cluster: ClusterSpec,
                      ) -> tuple[PipeshardParallel, ShardParallel | None]:
    """(the pipeline to run, the method its stage ILPs follow: None for a real pipeline)."""
    if isinstance(method, PipeshardParallel):
        warn_one_microbatch(method)
        return method, None
    return accumulation_method(method, mesh_shape, cluster), method


def plan(fun: Callable, *args, cluster: ClusterSpec, method: ShardParallel | None = None,
         mesh_shape: Sequence[int] | None = None, axis_names: Sequence[str] | None = None,
         batch_argnums: Sequence[int] = DEFAULT_BATCH_ARGNUMS, static_argnums: Sequence[int] = (),
         donate_argnums: Sequence[int] = (), verbose=None) -> ParallelPlan:
    """Plan `fun(*args)` for a cluster this machine need not have.

    `args` may be abstract (`jax.ShapeDtypeStruct`, e.g. from `jax.eval_shape`), so a large
    model is planned without allocating it. The logical mesh defaults to
    (num_hosts, devices_per_host).

    Example:
        >>> cluster = autopar.ClusterSpec.preset("dgx-a100", num_hosts=2)
        >>> abstract_state = jax.eval_shape(create_state)
        >>> p = autopar.plan(train_step, abstract_state, batch_spec, cluster=cluster)

    `verbose`: progress while planning, as in `parallelize` (see `autopar.progress`).
    """
    static = as_argnums(static_argnums, "static_argnums", none_ok=True)
    bound = BoundCall(tuple(args), static_argnums=static, names=arg_names(fun, len(args)),
                      batch_argnums=as_argnums(batch_argnums, "batch_argnums"))
    with progress.session(verbose, getattr(fun, "__name__", "step")), no_full_collections(), \
            bound as call:     # NNX objects as their states, Equinox modules' arrays traced
        return _plan(PureStep(fun), *call.args, cluster=cluster, method=method,
                     mesh_shape=mesh_shape, axis_names=axis_names, batch_argnums=batch_argnums,
                     static_argnums=static, donate_argnums=donate_argnums)


def _plan(fun, *args, cluster, method, mesh_shape, axis_names, batch_argnums, static_argnums,
          donate_argnums) -> ParallelPlan:
    method = method_instance(method) or ShardParallel()
    check_cluster(cluster, required=True)     # the cluster to plan for: no devices to read
    batch_argnums = as_argnums(batch_argnums, "batch_argnums")
    static_argnums = as_argnums(static_argnums, "static_argnums", none_ok=True)
    donate_argnums = as_argnums(donate_argnums, "donate_argnums", none_ok=True)
    if mesh_shape is None:
        mesh_shape = (cluster.num_hosts, cluster.devices_per_host)
    axis_names = tuple(axis_names or ("data", "model", "z", "w")[:len(mesh_shape)])
    if pipelined(method):
        pipe, stage_method = pipeline_methods(method, mesh_shape, cluster)
        kw = dict(static_argnums=static_argnums, batch_argnums=batch_argnums,
                  donate_argnums=donate_argnums)
        fun, step = pipeline_step(fun, tuple(args), kw)      # an eval step: forward-only
        return stamped(plan_pipeline(
            fun, tuple(args), cluster=cluster, device_ids=tuple(range(cluster.num_devices)),
            mesh_shape=tuple(mesh_shape), method=pipe, stage_method=stage_method,
            step_graph=step, **kw)[0])
    graph = trace(fun, args, static_argnums=static_argnums, batch_argnums=batch_argnums,
                  donate_argnums=donate_argnums)
    check_batch(graph, batch_argnums)

    def plan_with(g, m):
        return plan_graph(g, cluster, mesh_shape, axis_names, m, tuple(range(cluster.num_devices)))
    plan_, graph = plan_step(graph, functools.partial(plan_with, m=method), method,
                             tied=cluster.hoists_recomputation())
    return stamped(with_runner_ups(plan_, method, functools.partial(plan_with, graph)))


def plan_cache_of(option) -> PlanCache | None:
    """`parallelize(plan_cache=...)`: True = the default directory (`AUTOPAR_PLAN_CACHE=off`
    turns it off, a path there moves it), a path = that directory, False / None = off."""
    if option is True:
        env, off = env_setting()
        return None if off else PlanCache(env or None)
    if option is False or option is None:
        return None
    if isinstance(option, (str, os.PathLike)):
        return PlanCache(option)
    raise InvalidArgumentError(
        f"plan_cache={option!r} must be True (the default cache directory), a directory path, "
        "or False (no plan cache).")


def matching(plan_: ParallelPlan, fingerprint: str, graph: OpGraph | None = None,
             ) -> ParallelPlan:
    """`plan_` if it was made for the traced step with this fingerprint, else a clear error
    naming the argument leaves whose shape or dtype changed (`graph`: the traced step)."""
    if plan_.graph_fingerprint != fingerprint:
        raise PlanMismatchError(
            f"the saved plan was made for a different function or argument shapes: "
            f"{changed_leaves(plan_, graph)} (plan fingerprint {plan_.graph_fingerprint}, this "
            f"call {fingerprint}). Fix: re-plan (parallelize without plan=, or "
            f"step.get_plan(...) on these arguments), or call with the shapes the plan was "
            f"made for.")
    return plan_


def graph_of(plan_: ParallelPlan, graph: OpGraph, search) -> tuple[ParallelPlan, OpGraph]:
    """(plan, the graph it was made for: `remat_plan.traced_for`). A plan from the plan cache
    whose recorded rewrite does not match this code's (an entry written by other code of the
    same version, as a development checkout leaves) is searched again (`search()` gives the
    plan and its graph), with a warning."""
    try:
        return plan_, traced_for(plan_, graph)
    except PlanMismatchError:
        if plan_.origin != "plan cache":
            raise
        log.warning("autopar: the plan cache's plan does not match this step; re-planning")
        return search()


def changed_leaves(plan_: ParallelPlan, graph: OpGraph | None) -> str:
    """What differs between the plan's inputs and the traced step's, e.g. "argument 1 leaf
    batch['x']: (16, 16) float32 -> (32, 16) float32"."""
    if graph is None:
        return "the traced step differs"
    now = [graph.tensors[t] for t in graph.inputs]
    if len(now) != len(plan_.inputs):
        return (f"the plan has {len(plan_.inputs)} argument leaves, this call "
                f"{len(now)} (a leaf added or removed)")
    diffs = [f"argument {graph.arg_of_input[k]} leaf {t.path}: {p.shape} {p.dtype} -> "
             f"{t.shape} {t.dtype}" + (f" (was {p.path})" if p.path != t.path else "")
             for k, (p, t) in enumerate(zip(plan_.inputs, now))
             if (tuple(p.shape), p.dtype) != (t.shape, t.dtype)]
    if not diffs:
        return ("every argument leaf has the shape and dtype the plan was made for, so the "
                "function's operations (or a static argument) differ")
    more = f"; and {len(diffs) - 3} more" if len(diffs) > 3 else ""
    return "; ".join(diffs[:3]) + more


def layout_text(program) -> str:
    """Every sharding a pipeline program places values on, as text (to compare processes)."""
    parts = [repr(s) for s in program.in_shardings]
    for st in program.stages:
        parts += [repr(s) for s in (*st.param_shardings, *st.data_shardings,
                                    *st.act_shardings.values(), *st.out_shardings.values())]
    return "\n".join(parts)
