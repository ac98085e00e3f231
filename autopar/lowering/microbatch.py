"""The loss outputs of M microbatches merged into the full batch's, as `inter_op.reduction`
decided per output: rows put back in batch order, means, sums, and ratios of sums weighted
by each microbatch's share of the denominator (also the loss seeds of the backward pass).

Microbatch m holds examples m, m + M, m + 2M, ... of the batch (see `executor`), so an output
with the batch dimension is interleaved back, not concatenated end to end.

Example:
    >>> merge = Merger(loss, num_microbatches=4)
    >>> weights = merge.weights(*den_inputs)          # RATIO outputs: den_m / sum(den)
    >>> logits = merge(1, per_microbatch_logits)      # [B / 4, T, V] x 4 -> [B, T, V]
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from autopar.frontend.interpret import run_nodes
from autopar.inter_op.pipeline import LossGraph
from autopar.inter_op.reduction import Combine, OutputCombine


def interleave(values, *, dim: int, rows: int):
    """The full-batch value from microbatch values whose dimension `dim` holds `rows` examples
    (times a whole number of entries per example, e.g. a flattened [rows * T])."""
    m, shape = len(values), values[0].shape
    per_example = shape[dim] // rows
    split = [v.reshape(*shape[:dim], rows, per_example, *shape[dim + 1:]) for v in values]
    return jnp.stack(split, axis=dim + 1).reshape(*shape[:dim], rows * m * per_example,
                                                 *shape[dim + 1:])


add_all = jax.jit(lambda *xs: sum(xs[1:], xs[0]))     # the sum of equal-shaped arrays


def _weighted(weights, values):
    return sum((w * v for w, v in zip(weights[1:], values[1:])), weights[0] * values[0])


class Merger:
    """Jitted merges of one loss's outputs over `num_microbatches` microbatches."""

    def __init__(self, loss: LossGraph, num_microbatches: int):
        self.loss, self.m = loss, num_microbatches
        red = loss.reduction
        self.outputs = red.outputs if red is not None else tuple(
            OutputCombine(combine=Combine.UNKNOWN) for _ in loss.forward.outputs)
        self.rows = red.rows if red is not None else 1
        self.den_inputs = red.den_inputs if red is not None else ()
        self._mean = jax.jit(lambda *xs: sum(xs[1:], xs[0]) / len(xs))
        self._weighted = jax.jit(_weighted)
        self.weights = self._weights_fn() if red is not None and red.dens else None
        # the keys folded per microbatch, where the microbatches cannot draw their rows of the
        # whole batch's random bits (`inter_op.random_rows`): microbatch i draws from
        # fold_in(key, i), so that the microbatches at least draw different masks
        self.rng_inputs = frozenset(red.rng_inputs) if red is not None and red.folds_keys \
            else frozenset()
        self.fold_keys = jax.jit(lambda key: tuple(jax.random.fold_in(key, i)
                                                   for i in range(num_microbatches)))

    def _weights_fn(self) -> Callable:
        """(full-batch values of `den_inputs`) -> per denominator, its weight in each
        microbatch, in the loss's dtype: den_m / sum of the den_m for a plain sum (or mean)
        over examples, den_m / den of the whole batch for the others (`whole_dens`: a clamp,
        an epsilon; see `inter_op.reduction`'s RATIO)."""
        loss, m, red = self.loss, self.m, self.loss.reduction
        fwd = loss.forward
        nodes = [fwd.nodes[n] for n in red.den_nodes]
        dtype = fwd.tensors[fwd.outputs[0]].dtype

        full = red.full_forward

        def run(*inputs):
            dens = []
            for i in range(m):
                env = dict(fwd.const_values)
                for q, x in zip(red.den_inputs, inputs):
                    if q in loss.batch_inputs:
                        x = x.reshape(x.shape[0] // m, m, *x.shape[1:])[:, i]
                    env[fwd.inputs[q]] = x
                run_nodes(fwd, nodes, env)
                dens.append([env[d] for d in red.dens])
            whole = {}
            if red.whole_dens:      # the whole batch's denominators (the same node ids)
                env = dict(full.const_values)
                env.update((full.inputs[q], x) for q, x in zip(red.den_inputs, inputs))
                run_nodes(full, [full.nodes[n] for n in red.den_nodes], env)
                whole = {d: env[d] for d in red.whole_dens}
            totals = [whole[d] if d in whole else sum(x[j] for x in dens[1:]) + dens[0][j]
                      for j, d in enumerate(red.dens)]
            return [tuple((d[j] / total).astype(dtype) for d in dens)
                    for j, total in enumerate(totals)]
        return jax.jit(run)

    def seed(self) -> float:
        """The loss's cotangent in every microbatch, unless the loss is a RATIO (its seed
        is then each microbatch's weight)."""
        return 1.0 if self.outputs[0].combine == Combine.SUM else 1.0 / self.m

    def __call__(self, pos: int, values: list, weights: list | None = None):
        """Output `pos` of the loss merged from its microbatch values; `weights`: for a
        RATIO output, its per-microbatch weights on the values' devices."""
        out = self.outputs[pos]
        kind = out.combine
        if kind == Combine.UNKNOWN:
            floating = jnp.issubdtype(values[0].dtype, jnp.floating)
            kind = Combine.MEAN if floating else Combine.SUM
        if kind == Combine.MEAN and not jnp.issubdtype(values[0].dtype, jnp.floating):
            return values[0]     # the same in every microbatch (a count, a key): not averaged
        if kind == Combine.MEAN:
            return self._mean(*values)
        if kind == Combine.SUM:
            return add_all(*values)
        if kind == Combine.RATIO:
            return self._weighted(weights, values)
        return _interleaver(out.batch_dim, self.rows)(values)


@functools.cache
def _interleaver(dim: int, rows: int) -> Callable:
    return jax.jit(functools.partial(interleave, dim=dim, rows=rows))
