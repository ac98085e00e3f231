"""Matmul operands that XLA reads through a layout copy, and the cheap values those copies
compute (the candidates of the memory model's rule, `memory.memory_model`).

XLA's dot canonicalization (`DotDecomposer`) rewrites a `dot_general` that is not canonical
(one contracting dimension, at most one free dimension per operand, the batch dimensions
leading and in order) into one that is: it transposes the left operand to (batch, free,
contracting) and the right one to (batch, contracting, free). A transpose that moves no
dimension is a bitcast, a swap of an operand's two matrix dimensions is folded into the
matmul; any other is a copy, a loop fusion that XLA's fusion gives the operand's cheap
elementwise producers. So a cheap value (`exp(s) * (1 / sum)`, a softmax's probabilities)
read through such a copy is computed in it, and its other readers get it from a buffer XLA
writes just before the first of them. Read off the compiled Gemma step (grouped-query
attention: `bkgqs,bskd->bqkgd` reads the probabilities through a `copy_bitcast_fusion`, the
backward's matmul through a fusion of its own; none kept from the forward to the backward)
against GPT's (`bnqk,bknd->bqnd` is canonical: its matmuls read the probabilities as
written, kept for the backward); see benchmarks/memory_notes.md.

Example (`p = exp(x) * r` read by a grouped-query attention matmul):
    >>> found = recomputed_in_copies(graph, fused, materialized, expensive)   # doctest: +SKIP
    >>> copies, others = found[p]     # the matmuls that copy p, its other readers
"""
from __future__ import annotations

from autopar.core.graph import OpGraph
from autopar.core.primitives import ELEMENTWISE
from autopar.intra_op.fusion import OpKind, op_kind


def copied_operands(graph: OpGraph, node) -> tuple[bool, bool]:
    """Whether XLA's dot canonicalization copies the left / right operand of a `dot_general`:
    a transpose that moves a dimension and that XLA's transpose folding cannot take into the
    matmul (it folds a swap of the two matrix dimensions of an operand whose batch
    dimensions lead and which needs no reshape). (False, False) for other nodes and for
    canonical dots."""
    if node.primitive != "dot_general" or len(node.inputs) != 2:
        return False, False
    (lc, rc), (lb, rb) = node.eqn.params["dimension_numbers"]
    lb, rb, lc, rc = (tuple(int(d) for d in x) for x in (lb, rb, lc, rc))
    ranks = [graph.tensors[t].rank for t in node.inputs]
    lead = tuple(range(len(lb)))
    if not lc or (len(lc) == 1 and len(lb) + 2 >= ranks[0] and len(rb) + 2 >= ranks[1]
                  and lb == lead and rb == lead):
        return False, False          # canonical (or no contraction: not rewritten this way)

    def copied(rank, batch, contracting, free_first):
        free = tuple(d for d in range(rank) if d not in batch and d not in contracting)
        order = batch + (free + contracting if free_first else contracting + free)
        if order == tuple(range(rank)):
            return False
        matrix = batch == lead and len(free) == 1 and len(contracting) == 1
        return not (matrix and order[-2:] == (rank - 1, rank - 2))

    return copied(ranks[0], lb, lc, True), copied(ranks[1], rb, rc, False)


def recomputed_in_copies(graph: OpGraph, fused: list[bool], materialized: list[bool],
                         expensive) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per cheap elementwise value that an operand copy of a matmul computes (see the module
    docstring): (the matmuls reading it through a copy, the nodes reading it from memory
    as it is). The second are empty where only copies read it: then it is never written;
    else XLA writes it in a fusion of its own just before its first such reader.
    `fused[n]`: node n runs inside a fusion; `materialized[t]`: tensor t is written (before
    this rule); `expensive(n)`: XLA keeps node n's value out of its consumers' kernels (then
    the rule does not apply)."""
    outputs = set(graph.outputs)
    reads: dict[int, list[tuple[int, bool]]] = {}
    for node in graph.nodes:
        kind = op_kind(node.primitive)
        if kind not in (OpKind.KERNEL, OpKind.BARRIER, OpKind.REDUCE):
            continue
        copies = copied_operands(graph, node)
        for pos, t in enumerate(node.inputs):
            reads.setdefault(t, []).append((node.id, pos < 2 and copies[pos]))
    out = {}
    for t, readers in reads.items():
        p = graph.tensors[t].producer
        if (p is None or p < 0 or not fused[p] or expensive(p) or t in outputs
                or graph.nodes[p].primitive not in ELEMENTWISE or not materialized[t]
                or not any(copied for _, copied in readers)):
            continue
        copied = {n for n, c in readers if c}
        out[t] = (tuple(sorted(copied)),
                  tuple(sorted({n for n, c in readers if not c} - copied)))
    return out


__all__ = ["copied_operands", "recomputed_in_copies"]
