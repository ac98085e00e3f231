"""The pipeline executor: runs one step of a `PipelineProgram`.

A one-stage program with several microbatches (gradient accumulation) is one executable
(`PipelineProgram.whole_step`, see `lowering.accumulate`): the executor calls it. Otherwise
it walks the apply-gradient segments in order; the pipeline segment runs the schedule's clock
table, dispatching each stage's forward or backward for one microbatch and moving activations
and cotangents between submeshes with `jax.device_put`. Everything is dispatched
asynchronously; on simulated CPU devices, where too many queued calls with collectives hang
(see JAX_NOTES), it waits on the call `max_in_flight_calls` dispatches back.

Microbatch m holds examples m, m + M, m + 2M, ... of the batch: with the batch sharded over a
stage's devices, every microbatch is then sharded the same way without moving data.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autopar.inter_op.apply_grad import PIPELINE
from autopar.inter_op.schedule import Phase
from autopar.lowering.microbatch import Merger, add_all
from autopar.lowering.pipeline import PipelineProgram
from autopar.lowering.single_mesh import has_sharding, put


@dataclass(slots=True)
class ExecutorStats:
    """What the last step did (for tests and benchmarks)."""
    max_live_microbatches: list[int] = field(default_factory=list)  # per stage: residuals kept
    # per stage: every (in flight, deferred) pair it passed through: microbatches past their
    # F and before their B (residuals whole), past their B and before their W (only what W
    # reads kept), as `PipelineSchedule.kept_states` counts them
    kept_states: list[set] = field(default_factory=list)
    num_dispatches: int = 0
    num_transfers: int = 0
    order: list = field(default_factory=list)    # the schedule's tasks, in the order they ran


def retarget(value, mesh) -> NamedSharding:
    """The sharding `value` gets on another stage's mesh: its partition spec where every
    sharded dimension still divides, else replicated."""
    spec = getattr(getattr(value, "sharding", None), "spec", None)

    def fits(dim, entry) -> bool:
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        return (all(n in mesh.shape for n in names)
                and dim % int(np.prod([mesh.shape[n] for n in names])) == 0)

    if isinstance(spec, PartitionSpec) and all(map(fits, np.shape(value), spec)):
        return NamedSharding(mesh, spec)
    return NamedSharding(mesh, PartitionSpec())


def gathered(out: list, carried, pins: dict, whole: jax.sharding.Mesh) -> list:
    """A pipeline's results where the caller can use them together: result i where `pins`
    (out_shardings) says; else a value the step computed (a loss, metrics, logits) on the
    `whole` mesh, as `jax.jit` returns it, so that eager code mixing results of different
    stages runs. The next step's state (a `carried` result) stays on its stage. In a
    multi-process job every result stays where its stage made it (JAX copies an array between
    processes only onto as many devices as it is on)."""
    devices = set(whole.devices.flat)
    stays = range(len(out)) if jax.process_count() > 1 else carried

    def place(i, x):
        if i in pins:
            return put(x, pins[i])
        if i in stays or not isinstance(x, jax.Array) or x.sharding.device_set == devices:
            return x
        return put(x, retarget(x, whole))
    return [place(i, x) for i, x in enumerate(out)]


def _first_array(tree):
    """The first array of a call's results (lists and tuples, depth first), without
    flattening them all: a backward returns the whole gradient accumulator."""
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, jax.Array):
            return x
    return None


def _fused_tasks(schedule) -> frozenset[tuple[int, int]]:
    """(stage, microbatch) pairs whose forward and backward run as one call: on the last
    stage (nothing later sends it cotangents), when its group's next tasks after the forward
    of m are the backward of m (and in a split table its W): every microbatch under 1F1B,
    under GPipe only with one microbatch."""
    last = schedule.num_stages - 1
    tasks = schedule.tasks_of(schedule.group_of(last))
    run = tuple(Phase) if schedule.split_backward else (Phase.FORWARD, Phase.BACKWARD)
    return frozenset((last, ts[0].microbatch) for ts in zip(*(tasks[i:] for i in range(len(run))))
                     if all(t.stage == last and t.phase is p
                            and t.microbatch == ts[0].microbatch for t, p in zip(ts, run)))


@dataclass(slots=True, eq=False)
class _StepState:
    """What one step's pipeline keeps between tasks."""
    params: list                 # per stage: its parameters on its submesh
    data: list                   # per stage, per microbatch: its data inputs
    outs: dict = field(default_factory=dict)       # (tensor, microbatch) -> stage output
    left: dict = field(default_factory=dict)       # (tensor, microbatch) -> readers to come
    residuals: list = field(default_factory=list)  # per stage: microbatch -> residuals
    cts: dict = field(default_factory=lambda: collections.defaultdict(list))
    acc: list = field(default_factory=list)        # per stage: accumulated param gradients
    handoffs: list = field(default_factory=list)   # per stage: microbatch -> B's hand-off to W
    final: dict = field(default_factory=dict)      # loss output tensor -> per-microbatch values
    in_flight: list = field(default_factory=list)  # per stage: microbatches between F and B
    deferred: list = field(default_factory=list)   # per stage: microbatches between B and W
    weights: dict = field(default_factory=dict)    # RATIO denominator -> per-microbatch weights


class Executor:
    def __init__(self, program: PipelineProgram):
        self.p = program
        self.stats = ExecutorStats()
        self._window: collections.deque = collections.deque()
        self._consts: dict[Any, Any] = {}
        m = program.num_microbatches
        self._split = jax.jit(lambda x: tuple(x.reshape(x.shape[0] // m, m, *x.shape[1:])[:, i]
                                              for i in range(m)))
        self._merge = Merger(program.loss, m)
        self._sum = add_all
        ios = [st.io for st in program.stages]
        self._producer = {t: st.index for st, io in zip(program.stages, ios)
                          for t in (*io.float_outputs, *io.int_outputs)}
        self._readers = collections.Counter(t for io in ios for t in (*io.float_acts,
                                                                        *io.int_acts))
        self._fused = _fused_tasks(program.schedule)

    # -- dispatch bookkeeping ------------------------------------------------------------
    def _dispatched(self, out):
        self.stats.num_dispatches += 1
        limit = self.p.max_in_flight_calls
        if limit is None:
            return out
        first = _first_array(out)
        if first is not None:
            self._window.append(first)
        while len(self._window) > limit:
            oldest = self._window.popleft()
            if not oldest.is_deleted():     # a donated buffer: a later call consumed it
                oldest.block_until_ready()
        return out

    def _put(self, value, sharding):
        if has_sharding(value, sharding):
            return value
        self.stats.num_transfers += 1
        return self._move(value, sharding)

    def _move(self, value, sharding):
        return put(value, sharding)

    def _const(self, key, make):
        if key not in self._consts:
            self._consts[key] = self._made(make)
        return self._consts[key]

    def _made(self, make):
        return make()

    def _step_const(self, tid: int, sharding):
        """The step's constant `tid` (an array the step closes over, e.g. a numpy table the
        loss reads) on `sharding`, transferred on the first step only."""
        value = self.p.loss.step.const_values[tid]
        if not isinstance(value, jax.Array):
            value = np.asarray(value)
        return self._const(("step-const", tid, sharding), lambda: self._put(value, sharding))

    # -- one step ------------------------------------------------------------------------
    def run(self, flat_args) -> list:
        p = self.p
        step, place = p.loss.step, p.placement
        n = len(p.stages)
        self.stats = ExecutorStats(max_live_microbatches=[0] * n,
                                   kept_states=[{(0, 0)} for _ in range(n)])
        if p.whole_step is not None:    # gradient accumulation: the step is one executable
            return list(self._dispatched(p.whole_step(*flat_args)))
        env: dict[int, dict[int, Any]] = collections.defaultdict(dict)
        for tid, s, x in zip(step.inputs, place.input_stage, flat_args):
            env[tid][s] = x
        meshes = [st.mesh for st in p.stages]

        def get(tid, s, sharding=None):
            where = env[tid]
            if s in where and (sharding is None or has_sharding(where[s], sharding)):
                return where[s]
            if not where:     # a closed-over array (a constant of the step): placed once
                return self._step_const(tid, sharding or NamedSharding(meshes[s], PartitionSpec()))
            src = where[s] if s in where else next(iter(where.values()))
            val = self._put(src, sharding or retarget(src, meshes[s]))
            if sharding is None:
                where[s] = val
            return val

        for seg, fn in zip(place.segments, p.segment_fns):
            if seg.stage == PIPELINE:
                self._pipeline(get, env)
                continue
            outs = self._dispatched(fn(*(get(t, seg.stage) for t in seg.inputs)))
            for t, v in zip(seg.outputs, outs):
                env[t][seg.stage] = v
        results = []
        for pos, tid in enumerate(step.outputs):
            s = place.output_stage[pos]
            results.append(get(tid, s, p.in_shardings[step.carried_outputs[pos]]
                               if pos in step.carried_outputs else None))
        return results

    def _pipeline(self, get, env) -> None:
        p = self.p
        loss, m_total = p.loss, p.num_microbatches
        gnode = loss.step.nodes[loss.grad_node]
        params, data = [], []
        for st in p.stages:
            params.append([get(gnode.inputs[q], st.index, sh)
                           for q, sh in zip(st.slice.param_inputs, st.param_shardings)])
            per_mb = [[] for _ in range(m_total)]
            for q, sh in zip(st.slice.data_inputs, st.data_shardings):
                if q in loss.batch_inputs:
                    full = get(gnode.inputs[q], st.index, NamedSharding(st.mesh, sh.spec))
                    parts = self._dispatched(self._split(full)) if m_total > 1 else (full,)
                    parts = [self._put(x, sh) for x in parts]
                elif q in self._merge.rng_inputs and m_total > 1:     # a dropout key
                    keys = self._merge.fold_keys(get(gnode.inputs[q], st.index, sh))
                    parts = [self._put(k, sh) for k in self._dispatched(keys)]
                else:
                    parts = [get(gnode.inputs[q], st.index, sh)] * m_total
                for m in range(m_total):
                    per_mb[m].append(parts[m])
            data.append(per_mb)
        state = _StepState(params=params, data=data, residuals=[{} for _ in p.stages],
                           in_flight=[0] * len(p.stages), deferred=[0] * len(p.stages),
                           handoffs=[{} for _ in p.stages], acc=[None] * len(p.stages),
                           final={t: [] for t in loss.forward.outputs})
        if self._merge.weights is not None and m_total > 1:
            # A loss sum(num) / sum(den): each microbatch's share of the denominator, computed
            # from the batch on the loss's stage before any backward needs it as a seed.
            s = self._producer[loss.forward.outputs[0]]
            shares = self._dispatched(self._merge.weights(
                *(get(gnode.inputs[q], s) for q in self._merge.den_inputs)))
            state.weights = dict(zip(loss.reduction.dens, shares))
        split = p.schedule.split_backward
        run = {Phase.FORWARD: self._forward, Phase.WEIGHT: self._weight,
               Phase.BACKWARD: self._backward_input if split else self._backward}
        for task in p.schedule.order():
            st = p.stages[task.stage]
            if (task.stage, task.microbatch) not in self._fused:
                run[task.phase](state, st, task.microbatch)
                self.stats.order.append(task)
            elif task.phase is Phase.FORWARD:    # the later tasks of m run in this call
                self._train(state, st, task.microbatch)
                self.stats.order += [dataclasses.replace(task, phase=ph) for ph in Phase
                                     if split or ph is not Phase.WEIGHT]
        self._finish(env, gnode, state)

    def _acts(self, state: _StepState, st, m: int) -> list:
        """The stage's activation inputs for microbatch m, on its shardings; a value no later
        stage reads is dropped from the step state."""
        acts = []
        for t in (*st.io.float_acts, *st.io.int_acts):
            acts.append(self._put(state.outs[(t, m)], st.act_shardings[t]))
            state.left[(t, m)] -= 1
            if state.left[(t, m)] == 0 and t not in state.final:
                del state.outs[(t, m)]
        return acts

    def _outputs(self, state: _StepState, st, m: int, o, o_int) -> None:
        for t, v in zip((*st.io.float_outputs, *st.io.int_outputs), (*o, *o_int)):
            state.outs[(t, m)] = v
            state.left[(t, m)] = self._readers[t]
            if t in state.final:
                state.final[t].append(v)

    def _forward(self, state: _StepState, st, m: int) -> None:
        acts = self._acts(state, st, m)
        nf = len(st.io.float_acts)
        o, o_int, residuals = self._dispatched(
            st.forward(state.params[st.index], state.data[st.index][m], acts[:nf], acts[nf:],
                       self._index(st, m)))
        self._outputs(state, st, m, o, o_int)
        if st.backward is None:              # forward-only: nothing kept for a backward
            return
        live = state.residuals[st.index]     # with the inputs the backward reads (no copies)
        live[m] = (residuals, state.params[st.index], state.data[st.index][m],
                   [acts[i] for i in st.saved_acts])
        self._count(state, st, +1, 0)

    def _train(self, state: _StepState, st, m: int) -> None:
        """Forward and backward of microbatch m in one call (the last stage, whose output
        cotangents are known before its forward): no residuals are kept."""
        acts = self._acts(state, st, m)
        nf = len(st.io.float_acts)
        o, o_int, state.acc[st.index], act_grads = self._dispatched(st.fused(
            state.params[st.index], state.data[st.index][m], acts[:nf], acts[nf:],
            self._cotangents(state, st, m), state.acc[st.index], self._index(st, m)))
        self._outputs(state, st, m, o, o_int)
        for t, g in zip(st.io.float_acts, act_grads):
            state.cts[(t, m)].append(g)

    def _count(self, state: _StepState, st, opened: int, deferred: int) -> None:
        """Track the stage's microbatches in flight (F to B) and deferred (B to W)."""
        k, stats = st.index, self.stats
        state.in_flight[k] += opened
        state.deferred[k] += deferred
        stats.kept_states[k].add((state.in_flight[k], state.deferred[k]))
        peak = stats.max_live_microbatches
        peak[k] = max(peak[k], len(state.residuals[k]))

    def _backward(self, state: _StepState, st, m: int) -> None:
        self._count(state, st, -1, 0)
        state.acc[st.index], act_grads = self._dispatched(
            st.backward(state.residuals[st.index].pop(m), self._cotangents(state, st, m),
                        state.acc[st.index], self._index(st, m)))
        for t, g in zip(st.io.float_acts, act_grads):
            state.cts[(t, m)].append(g)

    def _backward_input(self, state: _StepState, st, m: int) -> None:
        """B of a split backward: the activation gradients; the residuals stay for W."""
        live = state.residuals[st.index]
        cts = self._cotangents(state, st, m)
        if st.backward_input is None:       # no activation gradients: W reads the cotangents
            act_grads, state.handoffs[st.index][m] = [], [cts[i] for i in st.handoff_cts]
        else:
            act_grads, state.handoffs[st.index][m] = self._dispatched(st.backward_input(
                live[m], cts, self._index(st, m)))
        for t, g in zip(st.io.float_acts, act_grads):
            state.cts[(t, m)].append(g)
        residuals, params, data, acts = live[m]      # W keeps only what it reads
        live[m] = ([residuals[i] for i in st.weight_residuals], params, data,
                   [acts[j] for j in st.weight_acts])
        self._count(state, st, -1, +1)

    def _weight(self, state: _StepState, st, m: int) -> None:
        """W of a split backward: the parameter gradients into the accumulator."""
        state.acc[st.index] = self._dispatched(st.backward_weight(
            state.residuals[st.index].pop(m), state.handoffs[st.index].pop(m),
            state.acc[st.index], self._index(st, m)))
        self._count(state, st, 0, -1)

    def _index(self, st, m: int):
        """Microbatch m's index on the stage's devices (its random draws are its rows of the
        whole batch's), placed once."""
        whole = NamedSharding(st.mesh, PartitionSpec())
        return self._const(("microbatch", st.index, m),
                           lambda: jax.device_put(np.int32(m), whole))

    def _cotangents(self, state: _StepState, st, m: int) -> list:
        """Cotangent of each float output: the gradients later stages sent back, the loss seed
        1/M for the loss, zeros for outputs nothing differentiates."""
        fwd = self.p.loss.forward
        ct = []
        for t in st.io.float_outputs:
            sh = st.out_shardings[t]
            t_info = fwd.tensors[t]
            parts = [self._put(g, sh) for g in state.cts.pop((t, m), [])]
            if t == fwd.outputs[0]:
                parts.append(self._seed(state, st, m, sh))
            if not parts:
                parts.append(self._const(("zeros", t), lambda: jax.device_put(
                    jnp.zeros(t_info.shape, t_info.dtype), sh)))
            ct.append(parts[0] if len(parts) == 1 else self._dispatched(self._sum(*parts)))
        return ct

    def _seed(self, state: _StepState, st, m: int, sh):
        """The loss's cotangent in microbatch m: 1 / M for a mean, 1 for a sum, the
        microbatch's share of the denominator for a ratio (see `lowering.microbatch`)."""
        den = self._merge.outputs[0].den
        if den is not None and self.p.num_microbatches > 1:
            return self._put(state.weights[den][m], sh)
        dtype = self.p.loss.forward.tensors[self.p.loss.forward.outputs[0]].dtype
        return self._const(("seed", st.index), lambda: jax.device_put(
            jnp.asarray(self._merge.seed(), dtype), sh))

    def _finish(self, env, gnode, state: _StepState) -> None:
        """The marker's results: the loss and aux merged over microbatches as
        `loss.reduction` says (means, sums, weighted ratios, rows back in batch order), and
        each parameter's gradient summed over the stages that read it."""
        p = self.p
        fwd = p.loss.forward
        for pos, t in enumerate(fwd.outputs):
            vals, s = state.final[t], self._producer[t]
            if len(vals) > 1:
                weights = state.weights.get(self._merge.outputs[pos].den)
                if weights is not None:        # a ratio: its weights, on its stage
                    whole = NamedSharding(p.stages[s].mesh, PartitionSpec())
                    weights = [self._put(w, whole) for w in weights]
                vals = [self._dispatched(self._merge(pos, vals, weights))]
            env[gnode.outputs[pos]] = {s: vals[0]}
        if p.loss.forward_only:         # no gradients
            return
        n_val = len(fwd.outputs)
        by_param: dict[int, list] = collections.defaultdict(list)
        for st in p.stages:
            acc = state.acc[st.index]
            if st.reduce is not None:      # partial sums: the step's one gradient reduction
                acc = self._dispatched(st.reduce(acc))
            for q, g in zip(st.slice.param_inputs, acc):
                by_param[q].append((st.index, g))
        for q in range(p.loss.num_diff):
            parts = by_param.get(q)
            if not parts:        # the loss never reads it: a zero gradient on stage 0
                t = fwd.tensors[fwd.inputs[q]]
                zero = self._const(("zero-grad", q), lambda: jnp.zeros(
                    t.shape, t.dtype, device=NamedSharding(p.stages[0].mesh, PartitionSpec())))
                env[gnode.outputs[n_val + q]] = {0: zero}
                continue
            home, first = parts[0]
            if len(parts) > 1:
                rest = [self._put(g, first.sharding) for _, g in parts[1:]]
                first = self._dispatched(self._sum(first, *rest))
            env[gnode.outputs[n_val + q]] = {home: first}
