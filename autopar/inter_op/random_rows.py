"""Random draws that carry the batch, so that microbatches draw exactly the whole batch's bits.

A loss that draws random bits (dropout masks) with a batch dimension draws B rows at the full
batch size and B / M rows per microbatch. Under JAX's partitionable threefry
(`jax_threefry_partitionable`, on by default) every element of a draw is a function of the key
and of that element's index in the array alone, so microbatch m can compute exactly the rows of
the whole batch's draw that belong to its examples (m, m + M, ...; see
`lowering.microbatch_bits`): with the same key in every microbatch, the loss and its gradients
are the whole batch step's. Draws without a batch dimension (the same shape at both sizes) are
the same in every microbatch, as in the whole batch's step.

This pass finds the draws: the `random_bits` and `random_split` nodes of the loss's forward
graph (at the microbatch size) whose shape differs from the same node's in the loss traced at
the full batch size, in one dimension, by the factor M. Where that cannot be shown (the two
traces differ in structure, a draw from a batch of keys, two dimensions that grow, the flag
off, a key that is not threefry), the microbatches draw from `fold_in(key, m)` instead (other
masks than the whole batch's) and the reason is returned for a warning.

Example:
    >>> draws, why = batch_draws(forward, full_forward, num_microbatches=4, rows=8)
    >>> draws
    (RandomRows(primitive='random_bits', shape=(8, 128, 64), dim=0, per_example=1),)
"""
from __future__ import annotations

from dataclasses import dataclass

import jax

from autopar.core.graph import OpGraph

DRAWS = frozenset({"random_bits", "random_split"})


@dataclass(frozen=True, slots=True)
class RandomRows:
    """A draw (of one key) whose dimension `dim` holds the examples: `per_example` entries each
    (1; T where the batch is flattened with a sequence, [B * T, ...])."""
    primitive: str
    shape: tuple[int, ...]      # the draw's `shape` at the microbatch size
    dim: int
    per_example: int


def _key_impl_name(graph: OpGraph, tid: int) -> str:
    dtype = graph.tensors[tid].key_dtype
    return str(dtype) if dtype is not None else "key<fry>"    # raw uint32 keys: threefry


def batch_draws(forward: OpGraph, full: OpGraph | None, *, num_microbatches: int,
                rows: int) -> tuple[tuple[RandomRows, ...], str]:
    """(the draws that carry the batch, '' or why the microbatches must fold their keys).
    `full`: the loss at the full batch size, node for node (None where the traces differ);
    `rows`: examples per microbatch."""
    nodes = [n for n in forward.nodes if n.primitive in DRAWS]
    if not nodes:
        return (), ""
    if full is None:
        return (), ("the loss traced at the full batch size has another structure, so its "
                    "random draws cannot be matched with the microbatch's")
    if not jax.config.jax_threefry_partitionable:
        return (), ("jax_threefry_partitionable is off, so a slice of a random array cannot be "
                    "drawn on its own. Fix: jax.config.update('jax_threefry_partitionable', "
                    "True)")
    found: dict[tuple[str, tuple[int, ...]], RandomRows] = {}
    same: set[tuple[str, tuple[int, ...]]] = set()
    for node in nodes:
        mine = tuple(node.eqn.params["shape"])
        other = tuple(full.nodes[node.id].eqn.params["shape"])
        if mine == other:     # no batch dimension: every microbatch draws the same bits
            same.add((node.primitive, mine))
            continue
        where = f"a {node.primitive} of shape {mine} ({node.source})"
        grown = [d for d, (a, b) in enumerate(zip(mine, other)) if a != b]
        if forward.tensors[node.inputs[0]].rank:
            return (), f"{where} draws from a batch of keys"
        if _key_impl_name(forward, node.inputs[0]) != "key<fry>":
            return (), f"{where} draws from a key that is not threefry2x32"
        if len(mine) != len(other) or len(grown) != 1 \
                or other[grown[0]] != mine[grown[0]] * num_microbatches \
                or mine[grown[0]] % rows:
            return (), (f"{where} has shape {other} at the full batch size: not one dimension "
                        f"{num_microbatches} times larger holding the examples")
        d = grown[0]
        draw = RandomRows(primitive=node.primitive, shape=mine, dim=d,
                          per_example=mine[d] // rows)
        if found.setdefault((node.primitive, mine), draw) != draw:
            return (), f"{where} and another draw of that shape hold the batch differently"
    if same & set(found):     # the executables tell draws apart by their shape
        return (), ("a draw with the batch and one without it have the same shape "
                    f"{next(iter(same & set(found)))[1]} at the microbatch size")
    return tuple(found.values()), ""
