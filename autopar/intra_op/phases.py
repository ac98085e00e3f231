"""Where a node runs in XLA's schedule of a training step, from the graph alone: the tail
(nodes from which no matmul is reachable: the loss value, the weight gradients and the
optimizer update, which XLA runs after the backward), the order the memory model walks
(`run_order`) and the reductions whose collectives XLA combines. The cost rules (`build`,
`rules`) and the memory model (`memory`) both read them.
"""
from __future__ import annotations

from autopar.core.graph import OpGraph
from autopar.core.primitives import MATMUL_LIKE, REDUCTIONS


def tail_nodes(graph: OpGraph) -> frozenset[int]:
    """Nodes from which no heavy operator is reachable (the loss value, the weight gradients
    and the optimizer update after the last matmul that feeds another)."""
    consumers = graph.consumers()
    feeds_heavy = [False] * len(graph.nodes)   # some later heavy op reads what v computes
    for node in reversed(graph.nodes):
        feeds_heavy[node.id] = any(graph.nodes[c].primitive in MATMUL_LIKE or feeds_heavy[c]
                                   for t in node.outputs for c in consumers[t])
    return frozenset(n.id for n in graph.nodes if not feeds_heavy[n.id])


def deferred_nodes(graph: OpGraph) -> frozenset[int]:
    """Nodes from which no heavy operator is reachable (e.g. gradient reductions feeding only
    the optimizer): XLA combines their independent collectives, so the ILP charges only the
    bandwidth term of each."""
    return tail_nodes(graph) | sibling_reductions(graph)


def sibling_reductions(graph: OpGraph) -> frozenset[int]:
    """Reductions whose all-reduce XLA combines with an earlier one's: same operand shape and
    axes, and independent of every reduction already in that combined all-reduce
    (BatchNorm's mean and mean of squares; the two sums of its gradient). The first of a
    combined set pays the latency, its siblings only their bandwidth."""
    below = [0] * len(graph.tensors)     # bitset of the reductions a tensor depends on
    sets: dict[tuple, list[int]] = {}    # (shape, axes) -> bitsets of the combined sets
    count, out = 0, set()
    for node in graph.nodes:
        mask = 0
        for t in node.inputs:
            mask |= below[t]
        if node.primitive in REDUCTIONS and node.inputs:
            key = (graph.tensors[node.inputs[0]].shape, tuple(node.eqn.params.get("axes", ())))
            combined = sets.setdefault(key, [])
            bit = 1 << count
            count += 1
            for i, members in enumerate(combined):
                if not members & mask:
                    combined[i] = members | bit
                    out.add(node.id)
                    break
            else:
                combined.append(bit)
            mask |= bit
        for o in node.outputs:
            below[o] = mask
    return frozenset(out)


def run_order(graph: OpGraph) -> list[int]:
    """The node order the memory model assumes XLA runs: the graph's, with the nodes from
    which no matmul is reachable (weight gradients, loss value, optimizer update) after all
    others, as XLA:CPU's memory scheduler places the weight-gradient matmuls after the whole
    backward."""
    tail = tail_nodes(graph)
    return ([n.id for n in graph.nodes if n.id not in tail]
            + [n.id for n in graph.nodes if n.id in tail])
