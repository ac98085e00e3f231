"""`parallelize`: the decorated step, which runs the passes (`passes.py`) once per argument
signature and then the compiled executables.

Example:
    >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
    >>> @autopar.parallelize(mesh=mesh, batch_argnums=(1,), donate_argnums=(0,))
    ... def train_step(state, batch):
    ...     loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    ...     return state.apply_gradients(grads=grads), loss
    >>> state, loss = train_step(state, batch)
    >>> print(autopar.dump(train_step.get_plan(state, batch)))
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from autopar import passes
from autopar.core import _compat, progress
from autopar.core.collector import no_full_collections
from autopar.core.errors import InvalidArgumentError, UnsupportedError
from autopar.core.graph import OpGraph
from autopar.core.options import ShardParallel
from autopar.core.plan import ParallelPlan, graph_fingerprint
from autopar.cost.cluster import ClusterSpec, check_cluster
from autopar.frontend import checks
from autopar.frontend.jit_options import PinnedShardings, argnums_for_names
from autopar.frontend.meshes import for_caller, no_context_mesh, relabel, under_mesh_if_needed
from autopar.frontend.nnx import PureStep, as_state
from autopar.frontend.step import StepFrontend
from autopar.frontend.tracer import abstract_signature, check_argnums, check_donated_aliases, trace
from autopar.inter_op.pipeshard import plan_pipeline, with_search_record
from autopar.inter_op.remat_plan import plan_step
from autopar.lowering.pipeline import lower_pipeline
from autopar.lowering.single_mesh import Lowered, lower, named, put
from autopar.runtime.distributed import check_agreement
from autopar.runtime.executor import Executor, gathered
from autopar.tools.plan_cache import cache_key, find_plan
from autopar.tools.runner_ups import with_runner_ups
from autopar.verify.memory_check import verified_plan
from autopar.verify.pipeline_memory_check import verified_pipeline, with_budget

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Entry:
    graph: OpGraph
    plan: ParallelPlan
    lowered: Lowered | None
    compiled: Any = None      # the XLA executable, compiled once (by a call or get_compiled)
    executor: Executor | None = None   # pipeline plans: runs the stages' executables
    out_pins: dict = dataclasses.field(default_factory=dict)  # pipelines: out_shardings
    needs_mesh: bool = False  # traced only under jax.set_mesh (explicit-sharding code)


class ParallelizedFunction:
    """What `parallelize` returns: call it like the original function."""

    _autopar_parallelized = True      # `frontend.checks.is_parallelized`

    def __init__(self, fun, *, mesh, method, static_argnums, donate_argnums, batch_argnums,
                 plan, cluster, plan_cache=True, pins: PinnedShardings | None = None,
                 verbose=None):
        functools.update_wrapper(self, fun)
        self._verbose = verbose
        self._user_fun, self._fun = fun, PureStep(fun)    # NNX arguments: see frontend.nnx
        self._mesh = mesh
        self._method = method or ShardParallel()
        self._static = tuple(static_argnums)
        self._donate = tuple(donate_argnums)
        self._batch = checks.as_argnums(batch_argnums, "batch_argnums")
        self._saved_plan = plan
        self._cluster = cluster
        self.plan_cache_of = plan_cache
        self._pins = pins or PinnedShardings()
        self._front = StepFrontend(fun=self._fun, static=self._static, donate=self._donate,
                                   batch=self._batch, pins=self._pins)
        self._plans = passes.plan_cache_of(plan_cache)
        self._cache: dict[Any, _Entry] = {}

    @property
    def mesh(self) -> jax.sharding.Mesh:
        if self._mesh is None:      # hosts x devices per host: the host axis is the slow one
            devices = np.array(jax.devices())
            self._mesh = jax.sharding.Mesh(devices.reshape(jax.process_count(), -1),
                                           ("data", "model"))
        return self._mesh

    def _key(self, args) -> Any:
        check_argnums("static_argnums", self._static, len(args))
        parts = []
        for i, a in enumerate(args):
            if i in self._static:
                parts.append(checks.static_part(self._fun, args, i))
            else:
                leaves, treedef = jax.tree_util.tree_flatten(a)
                parts.append((treedef, checks.leaf_signatures(
                    self._fun, args, i, leaves, abstract_signature)))
        return tuple(parts)

    def _signature(self, args) -> str:
        """The abstract arguments as text that is the same in every process and run: leaf
        paths, shapes, dtypes and static values (object addresses removed)."""
        parts = []
        for i, a in enumerate(args):
            if i in self._static:
                parts.append(f"{i}:static={re.sub(r' at 0x[0-9a-f]+', '', repr(a))}")
                continue
            for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
                shape, dtype, weak = abstract_signature(leaf)
                parts.append(f"{i}{jax.tree_util.keystr(path)}:{shape}{dtype.name}"
                             f"{'~' if weak else ''}")
        return ";".join(parts)

    def _find(self, args, fingerprint: str, mesh, search, method) -> ParallelPlan:
        """The plan: from the plan cache, from process 0 in a multi-process job, else
        `search()`."""
        key = cache_key(graph_fingerprint=fingerprint, args_signature=self._signature(args),
                        cluster=self.cluster, method=method,
                        mesh_shape=tuple(mesh.devices.shape), axis_names=tuple(mesh.axis_names),
                        device_ids=tuple(int(d.id) for d in mesh.devices.flat),
                        extra=f"batch={self._batch};static={self._static};donate="
                              f"{self._front.donated(args)};out={self._pins.out_shardings}")
        return find_plan(key, search, self._plans)

    def _entry(self, args) -> _Entry:
        key = self._key(args)
        entry = self._cache.get(key)
        if entry is None:
            needed = []      # the step traced only under the mesh
            with self._progress(), no_full_collections():
                entry = self._cache[key] = under_mesh_if_needed(
                    self._mesh, lambda: self._new_entry(args), needed)
            entry.needs_mesh = bool(needed)
        return entry

    def _new_entry(self, args) -> _Entry:
        mesh, method = self.mesh, self._front.method(args, self._method, self.mesh)
        if passes.pipelined(method):
            return self._pipeline_entry(args, mesh, method)
        graph = trace(self._fun, args, static_argnums=self._static, batch_argnums=self._batch,
                      donate_argnums=self._front.donated(args))
        passes.check_batch(graph, self._batch)
        searched = []

        def plan_with(g, m):
            return passes.plan_graph(g, self.cluster, mesh.devices.shape, mesh.axis_names, m,
                              tuple(int(d.id) for d in mesh.devices.flat),
                              output_pins=self._front.out_pins(g, args, self.mesh))

        def search():        # compiled and checked against the budget where it binds
            v = verified_plan(method, lambda m: plan_step(
                graph, functools.partial(plan_with, m=m), m,
                tied=self.cluster.hoists_recomputation()),
                lambda p, g: self._built(args, p, g, mesh))
            searched.append(dataclasses.replace(v, plan=with_runner_ups(
                v.plan, method, functools.partial(plan_with, v.graph))))
            return searched[0].plan
        if self._saved_plan is not None:
            plan_ = passes.matching(self._saved_plan, graph_fingerprint(graph), graph)
        else:
            plan_ = self._find(args, graph_fingerprint(graph), mesh, search, method)
        plan_, graph = (plan_, searched[0].graph) if searched else passes.graph_of(
            plan_, graph, lambda: (search(), searched[0].graph))
        entry = (searched[0].built if searched and searched[0].built is not None else
                 _Entry(graph=graph, plan=plan_, lowered=lower(graph, plan_, mesh)))
        entry.plan = plan_
        log.info("autopar: %s planned; XLA compiles it on the first call",
                 getattr(self._fun, "__name__", "step"))
        return entry

    def _pipeline_entry(self, args, mesh, method) -> _Entry:
        cluster = self.cluster
        method, stage_method = passes.pipeline_methods(method, mesh.devices.shape, cluster)
        kw = dict(static_argnums=self._static, batch_argnums=self._batch,
                  donate_argnums=self._front.donated(args))
        fun, step = passes.pipeline_step(self._fun, args, kw)
        fingerprint = graph_fingerprint(step)

        def run(m, sm=stage_method, solutions=()):
            return plan_pipeline(fun, args, cluster=cluster,
                                 device_ids=tuple(int(d.id) for d in mesh.devices.flat),
                                 mesh_shape=tuple(mesh.devices.shape), method=m,
                                 stage_method=sm, step_graph=step,
                                 stage_solutions=solutions, **kw)

        def program_of(parts):
            return lower_pipeline(parts.loss, parts.placement, parts.inter_op.stages,
                                  list(mesh.devices.flat), parts.schedule,
                                  method.num_microbatches, method.max_in_flight_calls,
                                  parts.local_grads)

        replay, searched, program = self._saved_plan, None, None
        if replay is None:
            def search():       # compiled and checked against the budget where a stage binds
                nonlocal searched, program
                made = verified_pipeline(lambda b: run(*with_budget(method, stage_method, b)),
                                         program_of, self._front.leaves(args))
                searched, program = (made.plan, *made.planned[1:]), made.program
                return made.plan
            replay = self._find(args, fingerprint, mesh, search, method)
        if searched is not None:      # `replay`: the searched plan as find_plan stamped it
            (_, parts, graph), plan_ = searched, replay
        else:      # a saved, cached or shared plan: replay its stages and their solutions
            passes.matching(replay, fingerprint, step)
            t0 = time.perf_counter()
            plan_, parts, graph = run(dataclasses.replace(
                method, stage_option=replay.stage_option()), solutions=replay.stage_solutions)
            origin = "saved plan" if self._saved_plan is not None else replay.origin
            plan_ = with_search_record(plan_, replay, origin, replay.timings_s.get(
                "plan_lookup", 0.0) + time.perf_counter() - t0)     # keeps its search record
        program = program or program_of(parts)
        log.info("autopar: %s planned as %s; XLA compiles each stage on the first call",
                 getattr(self._fun, "__name__", "step"),
                 f"a {len(plan_.stages)}-stage pipeline" if stage_method is None else
                 f"{method.num_microbatches}-microbatch gradient accumulation")
        check_agreement(fingerprint, passes.layout_text(program), "pipeline layouts")
        pins = {pos: named(_compat.auto_mesh(mesh), spec)
                for pos, spec in self._front.out_pins(graph, args, self.mesh).items()}
        return _Entry(graph=graph, plan=plan_, lowered=None, executor=Executor(program),
                      out_pins=pins)

    def _built(self, args, plan_: ParallelPlan, graph: OpGraph, mesh):
        """(an entry for `plan_`, its compiled executable): what `memory_check` checks."""
        entry = _Entry(graph=graph, plan=plan_, lowered=lower(graph, plan_, mesh))
        return entry, self._compiled(args, entry)

    def _compiled(self, args, entry: _Entry):
        if entry.compiled is None:
            with self._progress():
                entry.compiled = progress.compiled(lambda: self._lowered(args, entry))
        return entry.compiled

    def _progress(self):
        return progress.session(self._verbose, getattr(self._fun, "__name__", "step"))

    def _lowered(self, args, entry: _Entry):
        abstract = [jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=s)
                    for x, s in zip(self._front.leaves(args), entry.lowered.in_shardings)]
        with no_context_mesh():
            return entry.lowered.jitted.lower(*abstract)

    def lower(self, *args, **kwargs):
        """The step lowered for these arguments, as `jax.jit(f).lower(...)` gives it
        (`.as_text()`: the StableHLO with the plan's shardings; `.compile()`). Single-mesh
        plans only: a pipeline runs one executable per stage (see `get_compiled`)."""
        entry, args = self._entry_of(args, kwargs)
        if entry.executor is not None:
            raise InvalidArgumentError("lower: a pipeline plan runs one executable per stage; "
                                       "use get_compiled(...) for its PipelineProgram.")
        return self._lowered(args, entry)

    def __call__(self, *args, **kwargs):
        with self._front.bind(args, kwargs) as call:
            return call.finish(self._fun, self._call(call.args))

    def _call(self, args):
        leaves = self._front.leaves(args)
        if any(isinstance(x, _compat.Tracer) for x in leaves):
            raise UnsupportedError(
                f"autopar.parallelize: {getattr(self._fun, '__name__', 'the step')} was called "
                "inside a JAX transformation (jax.jit, jax.grad, jax.vmap, ...) with traced "
                "arguments; a parallelized step runs its own compiled executables on the mesh "
                "and cannot be traced into another program. Fix: call it at the top level (it "
                "is compiled already), or transform the plain function and parallelize that.")
        checks.check_concrete(self._fun, args, leaves, self._static)
        check_donated_aliases(self._fun, args, self._static, self._front.donated(args))
        entry = self._entry(args)
        pipeline = entry.executor is not None
        shardings = entry.executor.p.in_shardings if pipeline else entry.lowered.in_shardings
        compiled = None if pipeline else self._compiled(args, entry)
        with no_context_mesh():
            flat = [put(relabel(x, s), s) for x, s in zip(leaves, shardings)]
            out = progress.first_run(entry.executor, flat, self._progress) if pipeline \
                else compiled(*flat)
            if pipeline:
                out = gathered(out, entry.executor.p.loss.step.carried_outputs,
                               entry.out_pins, _compat.auto_mesh(self.mesh))
        return jax.tree_util.tree_unflatten(entry.graph.out_tree,
                                            for_caller(out, self._mesh, entry.needs_mesh))

    def input_shardings(self, *args) -> tuple:
        """Where the plan for these arguments places each positional argument: one pytree of
        `NamedSharding`s per argument (None for a static one), e.g. to restore a checkpoint
        straight onto the plan's layout.

        Example:
            >>> state_shardings = step.input_shardings(state, batch)[0]
            >>> state = autopar.restore_checkpoint(path, state_shardings)
        """
        entry, args = self._entry_of(args)
        flat = iter(entry.executor.p.in_shardings if entry.executor is not None
                    else entry.lowered.in_shardings)
        out = []
        for i, a in enumerate(args):
            if i in self._static:
                out.append(None)
                continue
            leaves, treedef = jax.tree_util.tree_flatten(a)
            tree = jax.tree_util.tree_unflatten(treedef, [next(flat) for _ in leaves])
            out.append(as_state(tree))      # an NNX argument: as nnx.state(arg) is shaped
        return tuple(out)

    def get_plan(self, *args, **kwargs) -> ParallelPlan:
        """The plan used for these arguments (planned now if not yet)."""
        return self._entry_of(args, kwargs)[0].plan

    def get_graph(self, *args) -> OpGraph:
        return self._entry_of(args)[0].graph

    def _entry_of(self, args, kwargs=None) -> tuple[_Entry, tuple]:
        """(the entry, the arguments as planned: NNX objects as their state pytrees)."""
        with self._front.bind(args, kwargs) as call:
            return self._entry(call.args), call.args

    def get_compiled(self, *args):
        """The compiled XLA executable these arguments run (`.as_text()` gives the HLO); for
        a pipeline plan, the `PipelineProgram` (per-stage executables)."""
        entry, args = self._entry_of(args)
        if entry.executor is not None:
            return entry.executor.p
        return self._compiled(args, entry)

    def with_cluster(self, cluster: ClusterSpec) -> ParallelizedFunction:
        """The same step, mesh, method and argnums, planned against `cluster` (a fresh
        function: nothing planned yet; a saved plan is not carried over)."""
        return self._fresh(mesh=self.mesh, cluster=check_cluster(cluster))

    def with_mesh(self, mesh: jax.sharding.Mesh | None = None) -> ParallelizedFunction:
        """The same step, method and argnums re-planned for another mesh (None: every device
        now present): elastic re-planning when the device count or mesh changes. Restore the
        state onto the new plan with `autopar.restore_checkpoint(path,
        new_step.input_shardings(abstract_state, batch)[0])` and train on.

        Example:
            >>> step8 = step.with_mesh(jax.make_mesh((1, 8), ("data", "model")))
        """
        return self._fresh(mesh=checks.check_mesh(mesh, "with_mesh: mesh"), cluster=None)

    def _fresh(self, *, mesh, cluster) -> ParallelizedFunction:
        return ParallelizedFunction(self._user_fun, mesh=mesh, method=self._method,
                                    static_argnums=self._static, donate_argnums=self._donate,
                                    batch_argnums=self._batch, plan=None, cluster=cluster,
                                    plan_cache=self.plan_cache_of, pins=self._pins,
                                    verbose=self._verbose)

    @property
    def cluster(self) -> ClusterSpec:
        """The cluster description plans are costed with (read off the mesh's devices unless
        one was given)."""
        return self._cluster or ClusterSpec.from_devices(self.mesh.devices.flat)

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        return self._donate

    def sample_plan(self, *args, seed: int, fraction: float = 1.0) -> ParallelPlan:
        """A random feasible plan for these arguments, costed by the same model: the ILP's
        plan with each strategy group redrawn at random with probability `fraction` (1.0: a
        fully random plan), seeded. For checking the cost model's ranking against measured
        step times; run it with `parallelize(fun, mesh=..., plan=p)`.

        Example:
            >>> p = step.sample_plan(state, batch, seed=3, fraction=0.3)
            >>> rand = autopar.parallelize(train_step, mesh=mesh, plan=p)
        """
        if passes.pipelined(self._method):
            raise InvalidArgumentError("sample_plan: random plans are drawn for single-mesh "
                                       "methods only (not pipelines or gradient accumulation).")
        with self._front.bind(args) as call:
            args = call.args
            graph = under_mesh_if_needed(self._mesh, lambda: trace(
                self._fun, args, static_argnums=self._static, batch_argnums=self._batch,
                donate_argnums=self._front.donated(args)))
        passes.check_batch(graph, self._batch)
        mesh = self.mesh
        return passes.plan_graph(graph, self.cluster, mesh.devices.shape, mesh.axis_names,
                           self._front.method(args, self._method, mesh),
                           tuple(int(d.id) for d in mesh.devices.flat),
                           perturb=(int(seed), float(fraction)),
                           output_pins=self._front.out_pins(graph, args, self.mesh))

    def get_executor(self, *args) -> Executor:
        """The pipeline executor of these arguments (its `stats` describe the last step)."""
        entry = self._entry_of(args)[0]
        if entry.executor is None:
            raise InvalidArgumentError("get_executor: this plan is not a pipeline (method is "
                                       "not PipeshardParallel, num_microbatches is 1).")
        return entry.executor

    def init(self, create_state: Callable, *example_args, state_argnum: int = 0,
             create_args: Sequence = ()):
        """Create the state this step takes (argument `state_argnum`) directly in its plan's
        layout, each device computing only its shards: `autopar.init_sharded(create_state,
        self, *example_args, ...)` (see there). `example_args` are the step's other
        arguments, concrete or `jax.ShapeDtypeStruct`; the first call reuses the plan.

        Example:
            >>> state = train_step.init(create_state, batch, create_args=(jax.random.key(0),))
            >>> state, loss = train_step(state, batch)
        """
        from autopar.runtime.init import init_sharded
        return init_sharded(create_state, self, *example_args, state_argnum=state_argnum,
                            create_args=create_args)


def parallelize(fun: Callable | None = None, *, mesh: jax.sharding.Mesh | None = None,
                method: ShardParallel | None = None, static_argnums: Sequence[int] = (),
                donate_argnums: Sequence[int] = (),
                batch_argnums: Sequence[int] = checks.DEFAULT_BATCH_ARGNUMS,
                plan: ParallelPlan | None = None, cluster: ClusterSpec | None = None,
                plan_cache: bool | str | os.PathLike = True, static_argnames=(),
                donate_argnames=(), in_shardings=None, out_shardings=None, verbose=None):
    """Parallelize a training step over a device mesh.

    Args:
      fun: the step, e.g. `train_step(state, batch) -> (state, loss)`, or an NNX step
        `train_step(model, optimizer, batch)` written for `nnx.jit`.
      mesh: a `jax.sharding.Mesh` (Auto or Explicit axes); None uses every device as a
        hosts x devices-per-host mesh (1 x N on one host).
      method: `ShardParallel()` (default), `DataParallel()`, `Zero2Parallel()`,
        `Zero3Parallel()` (any of them with `num_microbatches=M` for gradient accumulation)
        or `PipeshardParallel(...)`.
      static_argnums, donate_argnums: as in `jax.jit` (an int, a sequence of ints, or None).
      static_argnames, donate_argnames: as in `jax.jit`: parameter names (a str or a
        sequence), mapped to their positions through `fun`'s signature and added to the
        *_argnums (an argument passed by keyword binds to its position too).
      batch_argnums: positional arguments whose leaves carry the batch as dimension 0.
      plan: a saved `ParallelPlan` (e.g. `ParallelPlan.from_json(text)`): skip the search.
      cluster: a `ClusterSpec` to cost plans with instead of the one read off the devices.
      plan_cache: plans found by a search are kept on disk and reused by later runs (keyed
        by the traced step, argument shapes, cluster, mesh, method and autopar / JAX
        versions). True: `$AUTOPAR_PLAN_CACHE` if set (a directory, or `off`), else
        `$AUTOPAR_CACHE_DIR`, else `~/.cache/autopar/plans`; a path: that directory; False:
        no plan cache. A hit skips the search (`plan.origin` says "plan cache"). In a
        multi-process job process 0 finds the plan and the others receive it.
      in_shardings: as in `jax.jit`: a pytree prefix of the tuple of non-static positional
        arguments (one entry per argument), or one leaf for all of them. A leaf is a
        `PartitionSpec` over the mesh's axis names, a `NamedSharding` on `mesh`, or None
        (autopar chooses). Pinned leaves keep exactly that sharding; the plan is searched
        around them (like `ShardParallel(sharding_rules=...)`). For an NNX argument give
        one leaf for all its state.
      out_shardings: the same for the step's result (a prefix of it; for an NNX step, of
        what it returns). Pinned results come back in that layout (`out.sharding`): planned
        into it, or for a pipeline moved there after the last stage.
      verbose: progress while planning and compiling (see `autopar.progress`): None (the
        default) reads $AUTOPAR_VERBOSE (0 / 1 / 2), else shows progress on a terminal
        only; True / 1: a line per phase (a live bar on a terminal); 2: every step too;
        False / 0: nothing.

    Plans and executables are cached per abstract signature of the arguments (tree
    structure, shapes, dtypes, static values); a new shape re-plans.

    Flax NNX objects (`nnx.Module`, `nnx.Optimizer`, `nnx.Rngs`, `nnx.MultiMetric`, ...)
    are taken as `nnx.jit` takes them: the step updates them in place (optimizer updates,
    BatchNorm statistics, RNG counters, metrics, new attributes), objects shared between
    arguments stay shared, and their state is donated (arrays taken out of them before the
    call are invalid after it; copy them to keep them). See `autopar.frontend.nnx`.

    A state too big for one device is created directly in the plan's layout with
    `step.init(create_state, batch, create_args=(key,))` (see `autopar.init_sharded`).

    Example:
        >>> @autopar.parallelize(mesh=mesh, batch_argnums=(1,), donate_argnums=(0,))
        ... def train_step(state, batch): ...
        >>> @autopar.parallelize(mesh=mesh, batch_argnums=(2,))     # was @nnx.jit
        ... def nnx_step(model, optimizer, batch): ...
        >>> @autopar.parallelize(mesh=mesh, donate_argnames="state",
        ...                      in_shardings=(None, P("data")), out_shardings=(None, P()))
        ... def train_step(state, batch): ...
    """
    if fun is None:
        return functools.partial(
            parallelize, mesh=mesh, method=method, static_argnums=static_argnums,
            donate_argnums=donate_argnums, batch_argnums=batch_argnums, plan=plan,
            cluster=cluster, plan_cache=plan_cache, static_argnames=static_argnames,
            donate_argnames=donate_argnames, in_shardings=in_shardings,
            out_shardings=out_shardings, verbose=verbose)
    checks.check_mesh(mesh)
    progress.check(verbose, "parallelize: verbose")
    return ParallelizedFunction(
        fun, mesh=mesh, method=checks.method_instance(method), plan=checks.check_plan(plan),
        batch_argnums=checks.as_argnums(batch_argnums, "batch_argnums"),
        static_argnums=checks.as_argnums(static_argnums, "static_argnums", none_ok=True)
        + argnums_for_names(fun, static_argnames, "static_argnames"),
        donate_argnums=checks.as_argnums(donate_argnums, "donate_argnums", none_ok=True)
        + argnums_for_names(fun, donate_argnames, "donate_argnames"),
        cluster=check_cluster(cluster), plan_cache=plan_cache,
        pins=PinnedShardings.of(in_shardings, out_shardings), verbose=verbose)
