"""Gradient accumulation as one executable: the whole step of a one-stage `PipelineProgram`
(`ShardParallel(num_microbatches=M)`) in a single `jax.jit`.

The program's pieces are the executor's (`runtime.executor`), traced into one function
instead of dispatched one by one: the apply-gradient segments before the loss, then a
`lax.scan` over the M microbatches whose body is the stage's fused forward + backward
(`StageExecutable.fused`) and whose carry is the gradient accumulator (per-device partial
sums where `inter_op.local_grads` keeps them), then the accumulator's one reduction, the
loss outputs merged over microbatches (`lowering.microbatch.Merger`: means, sums, weighted
ratios, rows back in batch order), and the update segments; the donated state is donated
to the one executable. Every value keeps the sharding the executor would give it (the
stage's shardings are constraints inside the program), the microbatches are the executor's
(microbatch m holds examples m, m + M, ...) and the accumulator adds them in the same order,
so the results are the executor's (to XLA's rounding of the same sums: within 1e-6 in the
tests).

XLA sees the whole step: no host dispatch per microbatch, no transfers, one compile, and one
microbatch's activations live at a time (the scan's body). A forward-only step (an eval step
under `ShardParallel(num_microbatches=M)`) scans the stage's forward, with no accumulator.

`lower_pipeline` puts it in `PipelineProgram.whole_step`, and `runtime.executor.Executor`
runs it in place of the schedule.

Example:
    >>> jitted = accumulated_step(program)    # program: a one-stage PipelineProgram, M > 1
    >>> flat_results = jitted(*flat_args)
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from autopar.inter_op.apply_grad import PIPELINE
from autopar.inter_op.schedule import one_executable
from autopar.lowering.microbatch import Merger


def runs_whole(program) -> bool:
    """Whether `program` runs as one executable (`inter_op.schedule.one_executable`)."""
    return one_executable(len(program.stages), program.num_microbatches)


def _constrain(x, sharding):
    return jax.lax.with_sharding_constraint(x, sharding)


def _stacked_spec(sharding: NamedSharding) -> NamedSharding:
    """`sharding` of one microbatch, with a leading (unsharded) microbatch dimension."""
    return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))


def _stack(values):
    """Equal-shaped arrays (or typed PRNG keys) stacked along a new leading dimension."""
    if jnp.issubdtype(values[0].dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(values[0])
        data = jnp.stack([jax.random.key_data(v) for v in values])
        return jax.random.wrap_key_data(data, impl=impl)
    return jnp.stack(values)


def accumulated_step(program):
    """The whole step of `program` (one stage, M > 1 microbatches) as one `jax.jit`: the
    step's flat inputs (on `program.in_shardings`) -> its flat results, the state carried
    back on its input shardings and the user's donated inputs donated."""
    if not runs_whole(program):
        raise ValueError("accumulated_step lowers gradient accumulation on one stage (got "
                         f"{len(program.stages)} stages, {program.num_microbatches} "
                         "microbatches)")
    step = program.loss.step
    out_sh = [program.in_shardings[step.carried_outputs[pos]]
              if pos in step.carried_outputs else None for pos in range(len(step.outputs))]
    return jax.jit(_Traced(program), out_shardings=out_sh,
                   donate_argnums=tuple(sorted(step.donated_inputs)))


class _Traced:
    """The step's function, traced once by `accumulated_step`'s jit."""

    def __init__(self, program):
        self.p = program
        self._merge = Merger(program.loss, program.num_microbatches)

    def __call__(self, *flat_args):
        p = self.p
        step, place = p.loss.step, p.placement
        env: dict[int, Any] = dict(zip(step.inputs, flat_args))
        value = lambda t: env[t] if t in env else step.const_values[t]
        for seg, fn in zip(place.segments, p.segment_fns):
            if seg.stage == PIPELINE:
                self._pipeline(value, env)
                continue
            env.update(zip(seg.outputs, fn(*(value(t) for t in seg.inputs))))
        return [value(t) for t in step.outputs]

    def _pipeline(self, value, env) -> None:
        p, merge = self.p, self._merge
        loss, m_total, st = p.loss, p.num_microbatches, p.stages[0]
        gnode = loss.step.nodes[loss.grad_node]
        fwd = loss.forward
        params = [_constrain(value(gnode.inputs[q]), sh)
                  for q, sh in zip(st.slice.param_inputs, st.param_shardings)]
        fixed, scanned = {}, {}       # data input position -> value / [M, ...] stacked value
        for i, (q, sh) in enumerate(zip(st.slice.data_inputs, st.data_shardings)):
            x = value(gnode.inputs[q])
            if q in loss.batch_inputs:
                x = x.reshape(x.shape[0] // m_total, m_total, *x.shape[1:]).swapaxes(0, 1)
                scanned[i] = _constrain(x, _stacked_spec(sh))
            elif q in merge.rng_inputs:     # a dropout key: one per microbatch
                scanned[i] = _stack(merge.fold_keys(x))
            else:
                fixed[i] = _constrain(x, sh)
        seeds = None
        den = merge.outputs[0].den
        if merge.weights is not None:   # a ratio: each microbatch's share of its denominator
            shares = merge.weights(*(value(gnode.inputs[q]) for q in merge.den_inputs))
            weights = dict(zip(loss.reduction.dens, shares))
            if den is not None:
                seeds = jnp.stack(weights[den])
        else:
            weights = {}
        float_out = st.io.float_outputs
        loss_dtype = fwd.tensors[fwd.outputs[0]].dtype
        seed = jnp.asarray(merge.seed(), loss_dtype)

        def cotangents(seed_m):
            cts = []
            for t in float_out:
                if t == fwd.outputs[0]:
                    cts.append(_constrain(seed_m, st.out_shardings[t]))
                else:
                    info = fwd.tensors[t]
                    cts.append(_constrain(jnp.zeros(info.shape, info.dtype),
                                          st.out_shardings[t]))
            return cts

        def data_of(data_m):
            return [data_m[i] if i in data_m else fixed[i]
                    for i in range(len(st.slice.data_inputs))]

        def train(acc, xs):
            data_m, seed_m, mb = xs
            outs, int_outs, acc, _ = st.fused(params, data_of(data_m), [], [],
                                              cotangents(seed if seed_m is None else seed_m),
                                              acc, mb)
            return acc, (outs, int_outs)

        def forward(acc, xs):           # a forward-only step: no gradient, no accumulator
            data_m, _, mb = xs
            outs, int_outs, _ = st.forward(params, data_of(data_m), [], [], mb)
            return acc, (outs, int_outs)

        index = jnp.arange(m_total, dtype=jnp.int32)       # each microbatch's index
        if loss.forward_only:
            acc, (outs, int_outs) = jax.lax.scan(forward, [], (scanned, seeds, index))
        else:
            first = ({i: x[0] for i, x in scanned.items()},
                     None if seeds is None else seeds[0], index[0])
            shapes = jax.eval_shape(lambda xs: train(None, xs)[0], first)
            acc0 = [_constrain(jnp.zeros(s.shape, s.dtype), sh)
                    for s, sh in zip(shapes, st.acc_shardings)]
            acc, (outs, int_outs) = jax.lax.scan(train, acc0, (scanned, seeds, index))
        per_output = dict(zip((*float_out, *st.io.int_outputs), (*outs, *int_outs)))
        whole = NamedSharding(st.mesh, PartitionSpec())
        for pos, t in enumerate(fwd.outputs):
            stacked = per_output[t]
            vals = [stacked[m] for m in range(m_total)]
            w = weights.get(merge.outputs[pos].den)
            if w is not None:
                w = [_constrain(x, whole) for x in w]
            env[gnode.outputs[pos]] = merge(pos, vals, w)
        if loss.forward_only:           # no gradients
            return
        if st.reduce is not None:       # partial sums: the step's one gradient reduction
            acc = st.reduce(acc)
        grads = dict(zip(st.slice.param_inputs, acc))
        n_val = len(fwd.outputs)
        for q in range(loss.num_diff):
            if q in grads:
                env[gnode.outputs[n_val + q]] = grads[q]
            else:                       # the loss never reads it: a zero gradient
                info = fwd.tensors[fwd.inputs[q]]
                env[gnode.outputs[n_val + q]] = _constrain(jnp.zeros(info.shape, info.dtype),
                                                           whole)
