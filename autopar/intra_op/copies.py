"""Resharded copies that several readers share: one ILP variable per (value, layout).

XLA makes one copy of a value per layout it is moved to, and every operator that wants the
value in that layout reads that copy (its CSE merges the same collective on the same value;
`memory.copy_buffers` counts one buffer per (value, layout) for the same reason). A forward
activation moved for a matmul is read again by that matmul's weight gradient in the
backward; the expert outputs of a mixture-of-experts layer moved back to the batch layout are
read by the combine and by the combine's gradient. The ILP's edges (producer, reader) charge
the move on every reader, so the plain ILP avoids plans that move a value once for several
readers (the MoE layer's all-to-alls, in favour of all-gathers).

The *shared* ILP (`with_shared_copies`) charges each (value, layout) once. For a value t of
group u (spec `s_u[i]` under option i) and a layout w that at least two reads of t may want,
the copy gets a group c of two options, (absent, present):

    edge (u, c):   [i, present] = R(s_u[i], w)          the move, paid once
    edge (c, v):   [absent, a]  = max_i R(s_u[i], w)    for every option a of a reader v that
                                                        wants w
    edge (u, v):   [i, a]       -= R(s_u[i], w)         for those options: no longer per read

For every choice of u, `present` costs at most what `absent` costs, so an optimal plan has the
copy present whenever a read wants w (`settled`), and its objective is the cost of moving
each (value, layout) once. Reads inside a loop body (moved every iteration) keep their
per-read charge. The copy's bytes are not in the memory rows (the plan's prediction,
`memory.predicted_peak_bytes`, counts them).

The shared ILP is much harder for the MIP than the plain one (its LP relaxation lets half a
copy serve two half-readers): on the 2-layer OPT-style decoder of tests/api/test_relu_kink.py
on 2 x 4, its 823 copy groups took the solve from 1.1 s to the 60 s limit (gap 1.7%).
`solve.solve_intra_op` therefore solves it after the plain ILP, starting from the plain plan,
within a bounded time (`SHARED_TIME_FACTOR`), where it has at most as many copy groups as the
plain ILP has groups, and uses its plan only where it proves it optimal. Every plan's
predicted resharding counts each copy once (`duplicate_moves_s`).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from autopar.core.spec import Spec
from autopar.intra_op.ilp import IlpEdge, IlpProblem

ABSENT, PRESENT = 0, 1


@dataclass(frozen=True, slots=True)
class Read:
    """Node `node` (ILP group `group`) reads tensor `tensor` in `wanted[a]` under option a of
    its group (None: any layout)."""
    tensor: int
    group: int
    node: int
    wanted: tuple[Spec | None, ...]


@dataclass(frozen=True, slots=True)
class SharedCopy:
    """Group `group` of the shared ILP decides whether tensor `tensor` is moved to `spec`
    once for its readers: `readers` lists (reader's group, its options that want `spec`)."""
    group: int
    tensor: int
    spec: Spec
    nodes: tuple[int, ...]
    readers: tuple[tuple[int, tuple[int, ...]], ...]


def with_shared_copies(problem: IlpProblem, reads: list[Read], tensor_group: list[int],
                       tensor_specs: list[list[Spec]],
                       reshard: Callable[[int, Spec, Spec], float],
                       ) -> tuple[IlpProblem, tuple[SharedCopy, ...]]:
    """The shared ILP of `problem` (the plain one, whose edges charge every read in `reads`
    its move, keyed (group of the tensor, reader's group) as the builder adds them): a copy
    group after the plain groups for every (tensor, layout) that two or more reads may want
    and that some option of the tensor's group must move, the edges rewritten as the module
    docstring says. `reshard(tid, src, dst)`: seconds to move. No copy: `(problem, ())`."""
    edges: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        edges[(e.u, e.v)] = edges[(e.u, e.v)] + e.cost if (e.u, e.v) in edges \
            else np.array(e.cost, float)
    by_tensor: dict[int, list[Read]] = {}
    for r in reads:
        by_tensor.setdefault(r.tensor, []).append(r)
    n0, copies = len(problem.node_costs), []
    for tid, rs in by_tensor.items():
        if len(rs) < 2:
            continue
        u, specs = tensor_group[tid], tensor_specs[tid]
        wants = Counter(w for r in rs for w in set(r.wanted) if w is not None)
        for w, n in sorted(wants.items(), key=lambda kv: str(kv[0])):
            if n < 2:
                continue
            cost = np.array([reshard(tid, s, w) for s in specs], float)
            if not cost.any():
                continue
            c = n0 + len(copies)
            move = np.zeros((len(specs), 2))
            move[:, PRESENT] = cost
            edges[(u, c)] = move
            readers = []
            for r in rs:
                cols = [a for a, x in enumerate(r.wanted) if x == w]
                if not cols:
                    continue
                m = edges[(u, r.group)]
                m[:, cols] = np.maximum(m[:, cols] - cost[:, None], 0.0)
                penalty = np.zeros((2, len(r.wanted)))
                penalty[ABSENT, cols] = cost.max()
                key = (c, r.group)
                edges[key] = edges[key] + penalty if key in edges else penalty
                readers.append((r.node, r.group, tuple(cols)))
            copies.append(SharedCopy(group=c, tensor=tid, spec=w,
                                     nodes=tuple(x[0] for x in readers),
                                     readers=tuple(x[1:] for x in readers)))
    if not copies:
        return problem, ()
    shared = replace(problem, node_costs=(*problem.node_costs, *([np.zeros(2)] * len(copies))),
                     edges=tuple(IlpEdge(u=u, v=v, cost=m) for (u, v), m in edges.items()))
    return shared, tuple(copies)


class Mover:
    """`mover(tid, src, dst)`: seconds to move tensor `tid` of `graph` between layouts under the
    `cost.CostModel` `cost`, cached by (shape, itemsize, src, dst); `mover.matrix(tid, srcs,
    dsts)`: the [len(srcs), len(dsts)] table of those seconds (read-only), cached by the shape,
    itemsize and both layout lists. A model's repeated layers ask for the same tables, so each
    is computed once per build."""

    def __init__(self, graph, cost):
        self._graph, self._cost, self._one, self._tables = graph, cost, {}, {}

    def __call__(self, tid: int, src: Spec, dst: Spec | None) -> float:
        if dst is None or src == dst:
            return 0.0
        t = self._graph.tensors[tid]
        key = (t.shape, t.itemsize, src, dst)
        if key not in self._one:
            self._one[key] = self._cost.reshard_s(t.shape, t.itemsize, src, dst)
        return self._one[key]

    def matrix(self, tid: int, srcs, dsts) -> np.ndarray:
        t = self._graph.tensors[tid]
        key = (t.shape, t.itemsize, tuple(srcs), tuple(dsts))
        table = self._tables.get(key)
        if table is None:
            table = np.array([[self(tid, s, d) for d in dsts] for s in srcs], float)
            table.setflags(write=False)
            self._tables[key] = table
        return table


def duplicate_moves_s(reads, tensor_group: list[int], tensor_specs: list[list[Spec]], choice,
                      reshard: Callable[[int, Spec, Spec], float]) -> float:
    """Seconds the plain ILP's edges charge more than once under `choice`: for every (tensor,
    layout) that n > 1 of `reads` want, (n - 1) moves."""
    wanted: Counter = Counter()
    for r in reads:
        w = r.wanted[int(choice[r.group])]
        if w is not None:
            wanted[(r.tensor, w)] += 1
    return sum((n - 1) * reshard(tid, tensor_specs[tid][int(choice[tensor_group[tid]])], w)
               for (tid, w), n in wanted.items() if n > 1)


def reads_shared(problem: IlpProblem, reads, tensor_group: list[int]) -> IlpProblem:
    """The problem with each edge's cost divided by the most reads any tensor it carries has
    (`reads`): for every choice, its `evaluate` is at most the plain one less
    `duplicate_moves_s` (a tensor read n times pays each layout it is moved to once, so at
    least 1/n of what its n reads are charged), so its LP bound bounds the plans' accounted
    time from below."""
    count = Counter(r.tensor for r in reads)
    most: dict[tuple[int, int], int] = {}
    for r in reads:
        key = (min(tensor_group[r.tensor], r.group), max(tensor_group[r.tensor], r.group))
        most[key] = max(most.get(key, 1), count[r.tensor])
    edges = tuple(e if most.get((min(e.u, e.v), max(e.u, e.v)), 1) == 1 else
                  IlpEdge(u=e.u, v=e.v, cost=np.asarray(e.cost) / most[
                      (min(e.u, e.v), max(e.u, e.v))]) for e in problem.edges)
    return replace(problem, edges=edges)


def settled(copies: tuple[SharedCopy, ...], choice) -> tuple[int, ...]:
    """`choice` (one option per plain group) with every copy group after it: present exactly
    where a reader's chosen option wants the copy's layout (the shared ILP's best for it)."""
    extra = [PRESENT if any(int(choice[g]) in cols for g, cols in c.readers) else ABSENT
             for c in copies]
    return (*(int(i) for i in choice), *extra)


__all__ = ["Read", "SharedCopy", "with_shared_copies", "settled", "Mover",
           "duplicate_moves_s", "reads_shared", "ABSENT", "PRESENT"]
