"""Microbatch m's rows of the whole batch's random draws (`inter_op.random_rows`).

Under partitionable threefry, element i of `random_bits(key, shape)` is
`threefry2x32(key, (hi, lo) of i)` (combined per bit width), i the element's row-major index
in the array, and `random_split(key, shape)` stacks the two words into keys. So the rows of the
whole batch's draw that microbatch m's examples (m, m + M, m + 2M, ...) read are computed from
their indices in the whole array, never drawing the rest. `with_batch_draws` re-emits a stage
graph's matching draws this way, for the microbatch index `mb` the executable receives
(the same key in every microbatch).

Example:
    >>> graph_m = with_batch_draws(stage_graph, reduction.draws, num_microbatches=4, mb=mb)
    >>> run_nodes(graph_m, graph_m.nodes, env)      # under a trace: mb is a traced int32
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry2x32_p

from autopar.core.graph import OpGraph
from autopar.frontend.interpret import Reemitted
from autopar.inter_op.random_rows import RandomRows

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _indices(draw: RandomRows, num: int, mb) -> jax.Array:
    """uint32 [draw.shape]: each element's row-major index in the whole batch's draw."""
    shape = draw.shape
    full = list(shape)
    full[draw.dim] *= num
    lin = jnp.zeros(shape, jnp.uint32)
    for k in range(len(shape)):
        i = lax.broadcasted_iota(jnp.uint32, shape, k)
        if k == draw.dim:      # entry j of example r here is entry j of example r * M + mb
            pe = jnp.uint32(draw.per_example)
            i = ((i // pe) * jnp.uint32(num) + mb.astype(jnp.uint32)) * pe + i % pe
        lin = lin + i * jnp.uint32(math.prod(full[k + 1:]))
    return lin


def _words(key, draw: RandomRows, num: int, mb):
    data = jax.random.key_data(key)
    lo = _indices(draw, num, mb)
    return threefry2x32_p.bind(data[..., 0], data[..., 1], jnp.zeros_like(lo), lo)


class _Rows:
    """Stands in for a draw's primitive in `frontend.interpret.run_nodes`: binds to the rows of
    the whole batch's draw (as jax's partitionable threefry computes them)."""
    multiple_results = False

    def __init__(self, draw: RandomRows, num: int, mb):
        self.draw, self.num, self.mb = draw, num, mb
        self.name = draw.primitive

    def bind(self, key, **params):
        bits1, bits2 = _words(key, self.draw, self.num, self.mb)
        if self.draw.primitive == "random_split":
            data = jnp.stack([bits1, bits2], axis=bits1.ndim)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
        width = params["bit_width"]
        if width == 64:
            wide = _UINT[64]
            return lax.shift_left(bits1.astype(wide), wide(32)) | bits2.astype(wide)
        return (bits1 ^ bits2).astype(_UINT[width])


def with_batch_draws(graph: OpGraph, draws: tuple[RandomRows, ...], num_microbatches: int,
                     mb) -> OpGraph:
    """`graph` with every draw matching one of `draws` (its primitive and shape) computing
    microbatch `mb`'s rows of the whole batch's draw; tensors and nodes keep their ids."""
    if not draws:
        return graph
    by_shape = {(d.primitive, d.shape): d for d in draws}
    nodes = []
    for n in graph.nodes:
        draw = by_shape.get((n.primitive, tuple(n.eqn.params.get("shape", ()))),
                            None) if n.primitive in ("random_bits", "random_split") else None
        if draw is not None and not graph.tensors[n.inputs[0]].rank:
            n = dataclasses.replace(n, eqn=Reemitted(n.eqn, _Rows(draw, num_microbatches, mb)))
        nodes.append(n)
    return dataclasses.replace(graph, nodes=tuple(nodes))
