"""Repeated identical layers solved once and reused.

Models repeat a block (`block_0 ... block_11`, `Dense_0 ... Dense_5`). The ILP variables of
matching operators in every repeat are tied into one variable, so the ILP is about the size of
one layer plus the rest of the model. Ties are made with a period: period 1 gives every layer
the same strategies; period 2 lets consecutive layers alternate (as Megatron's column- then
row-parallel pairs do) and contains every period-1 plan, so the solver uses period 2.

Repeats are found from numbered module names in the jaxpr name stack and in parameter paths.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from autopar.core.graph import OpGraph
from autopar.intra_op.ilp import IlpEdge, IlpProblem
from autopar.intra_op.memory_points import fold_terms, point_rows

_NUMBERED = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z][A-Za-z0-9]*)_(\d+)(?![A-Za-z0-9_])")
MIN_REPEATS = 4


@dataclass(frozen=True, slots=True)
class Tying:
    family: str                 # e.g. "block"
    num_layers: int
    period: int
    rep: np.ndarray             # group -> tied variable index
    num_tied: int


def find_family(graph: OpGraph) -> tuple[str, int] | None:
    """The numbered module family with the most repeats (at least MIN_REPEATS)."""
    seen: dict[str, set[int]] = {}
    for node in graph.nodes:
        for m in _NUMBERED.finditer(node.name_stack):
            seen.setdefault(m.group(1), set()).add(int(m.group(2)))
    best = max(seen.items(), key=lambda kv: len(kv[1]), default=None)
    if best is None or len(best[1]) < MIN_REPEATS:
        return None
    return best[0], len(best[1])


def _layer_key(text: str, family: str) -> tuple[str, int | None]:
    layer = None

    def sub(m):
        nonlocal layer
        if m.group(1) != family:
            return m.group(0)
        layer = int(m.group(2))
        return f"{family}_*"
    return _NUMBERED.sub(sub, text), layer


def group_keys(graph: OpGraph, owners, family: str, signatures) -> list[tuple | None]:
    """Per ILP group: (canonical key, layer) for groups inside a repeat, else None."""
    keys: list[tuple | None] = []
    counter: Counter = Counter()
    for g, (kind, ident) in enumerate(owners):
        if kind == "input":
            text = graph.tensors[ident].path
        elif kind == "node":
            node = graph.nodes[ident]
            text = f"{node.name_stack}:{node.primitive}"
        else:
            keys.append(None)
            continue
        canon, layer = _layer_key(text, family)
        if layer is None:
            keys.append(None)
            continue
        occ = counter[(canon, layer)]
        counter[(canon, layer)] += 1
        keys.append((canon, occ, signatures[g], layer))
    return keys


def tie(keys, period: int, family: str, num_layers: int) -> Tying:
    classes: dict[tuple, int] = {}
    rep = np.empty(len(keys), dtype=np.int64)
    n = 0
    for g, key in enumerate(keys):
        ckey = ("free", g) if key is None else (key[0], key[1], key[2], key[3] % period)
        if ckey not in classes:
            classes[ckey] = n
            n += 1
        rep[g] = classes[ckey]
    return Tying(family=family, num_layers=num_layers, period=period, rep=rep,
                 num_tied=len(keys) - n)


def tied_problem(problem: IlpProblem, tying: Tying) -> IlpProblem:
    """The ILP over tied variables: member costs summed, edges mapped (an edge inside one tied
    variable contributes its diagonal), memory terms mapped."""
    rep = tying.rep
    n = int(rep.max()) + 1 if len(rep) else 0
    costs: list[np.ndarray | None] = [None] * n
    for g, c in enumerate(problem.node_costs):
        r = rep[g]
        costs[r] = np.array(c, float) if costs[r] is None else costs[r] + c
    edges: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        u, v = int(rep[e.u]), int(rep[e.v])
        if u == v:
            costs[u] = costs[u] + np.diag(e.cost)
            continue
        mat = e.cost if u < v else e.cost.T
        key = (min(u, v), max(u, v))
        edges[key] = edges[key] + mat if key in edges else np.array(mat, float)
    points: tuple = ()
    if problem.memory_points:
        rows = point_rows(problem.memory_points)
        points = fold_terms(rows.const, rows.term_point, rep[rows.term_group],
                            rows.lens, rows.vals)
    return IlpProblem(node_costs=tuple(costs), edges=tuple(IlpEdge(u=u, v=v, cost=m)
                                                            for (u, v), m in edges.items()),
                      memory_points=points, memory_budget_bytes=problem.memory_budget_bytes)
