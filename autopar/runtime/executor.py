"""The pipeline executor: runs one step of a `PipelineProgram`.

It walks the apply-gradient segments in order; the pipeline segment runs the schedule's clock
table, dispatching each stage's forward or backward for one microbatch and moving activations
and cotangents between submeshes with `jax.device_put`. Everything is dispatched
asynchronously; on simulated CPU devices, where too many queued calls with collectives hang
(see JAX_NOTES), it waits on the call `max_in_flight_calls` dispatches back.

Microbatch m holds examples m, m + M, m + 2M, ... of the batch: with the batch sharded over a
stage's devices, every microbatch is then sharded the same way without moving data.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..inter_op.apply_grad import PIPELINE
from ..lower_pipeline import PipelineProgram
from .schedule import Phase


@dataclass(slots=True)
class ExecutorStats:
    """What the last step did (for tests and benchmarks)."""
    max_live_microbatches: list[int] = field(default_factory=list)  # per stage: vjp residuals
    num_dispatches: int = 0
    num_transfers: int = 0


def _retarget(value, mesh) -> NamedSharding:
    """The sharding `value` gets on another stage's mesh: its partition spec where every
    sharded dimension still divides, else replicated."""
    sh = getattr(value, "sharding", None)
    spec = getattr(sh, "spec", None)
    if isinstance(spec, PartitionSpec):
        ok = True
        for dim, entry in zip(np.shape(value), spec):
            names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
            if not all(n in mesh.shape for n in names):
                ok = False
                break
            size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
            ok = ok and dim % size == 0
        if ok:
            return NamedSharding(mesh, spec)
    return NamedSharding(mesh, PartitionSpec())


class Executor:
    def __init__(self, program: PipelineProgram):
        self.p = program
        self.stats = ExecutorStats()
        self._window: collections.deque = collections.deque()
        self._consts: dict[Any, Any] = {}
        m = program.num_microbatches
        self._split = jax.jit(lambda x: tuple(x.reshape(x.shape[0] // m, m, *x.shape[1:])[:, i]
                                              for i in range(m)))
        self._mean = jax.jit(lambda *xs: sum(xs[1:], xs[0]) / len(xs))
        self._sum = jax.jit(lambda *xs: sum(xs[1:], xs[0]))

    # -- dispatch bookkeeping ------------------------------------------------------------
    def _dispatched(self, out):
        self.stats.num_dispatches += 1
        limit = self.p.max_in_flight_calls
        if limit is None:
            return out
        leaves = jax.tree_util.tree_leaves(out)
        if leaves:
            self._window.append(leaves[0])
        while len(self._window) > limit:
            oldest = self._window.popleft()
            if not oldest.is_deleted():     # a donated buffer: a later call consumed it
                oldest.block_until_ready()
        return out

    def _put(self, value, sharding):
        if getattr(value, "sharding", None) == sharding:
            return value
        self.stats.num_transfers += 1
        return jax.device_put(value, sharding)

    def _const(self, key, make):
        if key not in self._consts:
            self._consts[key] = make()
        return self._consts[key]

    # -- one step ------------------------------------------------------------------------
    def run(self, flat_args) -> list:
        p = self.p
        step, place = p.loss.step, p.placement
        self.stats = ExecutorStats(max_live_microbatches=[0] * len(p.stages))
        env: dict[int, dict[int, Any]] = collections.defaultdict(dict)
        for tid, s, x in zip(step.inputs, place.input_stage, flat_args):
            env[tid][s] = x
        meshes = [st.mesh for st in p.stages]

        def get(tid, s, sharding=None):
            where = env[tid]
            if s in where and (sharding is None or where[s].sharding == sharding):
                return where[s]
            src = where[s] if s in where else next(iter(where.values()))
            val = self._put(src, sharding or _retarget(src, meshes[s]))
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
        fwd = loss.forward
        gnode = loss.step.nodes[loss.grad_node]
        stages = p.stages
        slices = [st.io for st in stages]
        sl_of = [st.slice for st in stages]
        params, data = [], []
        for st, sl in zip(stages, sl_of):
            params.append([get(gnode.inputs[q], st.index, sh)
                           for q, sh in zip(sl.param_inputs, st.param_shardings)])
            per_mb = [[] for _ in range(m_total)]
            for q, sh in zip(sl.data_inputs, st.data_shardings):
                if q in loss.batch_inputs:
                    full = get(gnode.inputs[q], st.index,
                               NamedSharding(st.mesh, sh.spec))
                    parts = self._dispatched(self._split(full)) if m_total > 1 else (full,)
                    parts = [self._put(x, sh) for x in parts]
                else:
                    parts = [get(gnode.inputs[q], st.index, sh)] * m_total
                for m in range(m_total):
                    per_mb[m].append(parts[m])
            data.append(per_mb)
        producer = {t: st.index for st, io in zip(stages, slices)
                    for t in (*io.float_outputs, *io.int_outputs)}
        readers = collections.Counter(t for io in slices for t in (*io.float_acts, *io.int_acts))
        outs: dict[tuple[int, int], Any] = {}       # (tensor, microbatch) -> value
        left: dict[tuple[int, int], int] = {}       # forward readers still to come
        residuals: list[dict[int, Any]] = [dict() for _ in stages]
        cts: dict[tuple[int, int], list] = collections.defaultdict(list)
        acc: list[Any] = [None] * len(stages)
        final = {t: [] for t in fwd.outputs}
        loss_out = fwd.outputs[0]
        for row in p.schedule.clocks:
            for s, task in enumerate(row):
                if task is None:
                    continue
                st, io, m = stages[s], slices[s], task.microbatch
                if task.phase is Phase.FORWARD:
                    acts = []
                    for t in (*io.float_acts, *io.int_acts):
                        acts.append(self._put(outs[(t, m)], st.act_shardings[t]))
                        left[(t, m)] -= 1
                        if left[(t, m)] == 0 and t not in final:
                            del outs[(t, m)]
                    nf = len(io.float_acts)
                    o, io_, vjp_fn = self._dispatched(
                        st.forward(params[s], data[s][m], acts[:nf], acts[nf:]))
                    for t, v in zip((*io.float_outputs, *io.int_outputs), (*o, *io_)):
                        outs[(t, m)] = v
                        left[(t, m)] = readers[t]
                        if t in final:
                            final[t].append(v)
                    residuals[s][m] = vjp_fn
                    live = len(residuals[s])
                    self.stats.max_live_microbatches[s] = max(
                        self.stats.max_live_microbatches[s], live)
                else:
                    ct = []
                    for t in io.float_outputs:
                        sh = st.out_shardings[t]
                        parts = [self._put(g, sh) for g in cts.pop((t, m), [])]
                        if t == loss_out:
                            parts.append(self._const(("seed", s), lambda: jax.device_put(
                                jnp.asarray(1.0 / m_total, fwd.tensors[t].dtype), sh)))
                        if not parts:
                            parts.append(self._const(("zeros", t), lambda: jax.device_put(
                                jnp.zeros(fwd.tensors[t].shape, fwd.tensors[t].dtype), sh)))
                        ct.append(parts[0] if len(parts) == 1 else
                                  self._dispatched(self._sum(*parts)))
                    acc[s], act_grads = self._dispatched(
                        st.backward(residuals[s].pop(m), ct, acc[s]))
                    for t, g in zip(io.float_acts, act_grads):
                        cts[(t, m)].append(g)
        self._finish(get, env, gnode, acc, final, producer)

    def _finish(self, get, env, gnode, acc, final, producer) -> None:
        """The marker's results: mean loss and float aux over microbatches (integer aux
        summed), and each parameter's gradient summed over the stages that read it."""
        p = self.p
        fwd = p.loss.forward
        for pos, t in enumerate(fwd.outputs):
            vals = final[t]
            if len(vals) > 1:
                reduce = self._mean if jnp.issubdtype(vals[0].dtype, jnp.floating) else self._sum
                vals = [self._dispatched(reduce(*vals))]
            env[gnode.outputs[pos]] = {producer[t]: vals[0]}
        n_val = len(fwd.outputs)
        by_param: dict[int, list] = collections.defaultdict(list)
        for st in p.stages:
            for q, g in zip(st.slice.param_inputs, acc[st.index]):
                by_param[q].append((st.index, g))
        for q in range(p.loss.num_diff):
            out_tid = gnode.outputs[n_val + q]
            parts = by_param.get(q)
            if not parts:
                t = fwd.tensors[fwd.inputs[q]]
                mesh = p.stages[0].mesh
                env[out_tid] = {0: jnp.zeros(t.shape, t.dtype, device=NamedSharding(
                    mesh, PartitionSpec()))}
                continue
            home, first = parts[0]
            if len(parts) > 1:
                rest = [self._put(g, first.sharding) for _, g in parts[1:]]
                first = self._dispatched(self._sum(first, *rest))
            env[out_tid] = {home: first}

