"""Memory points of the intra-op ILP as numbers: `MemoryPoint` (bytes per device live at one
program point, per strategy of the groups it reads), their folded form, and `PointRows`, which
prices a choice at every point at once. No `jax`, no solver: `ilp` and `layers` build on it.

Example:
    >>> p = folded_point({0: np.array([4.0, 2.0])}, 10.0)
    >>> point_rows((p,)).usage([1])
    array([12.])
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryPoint:
    """Bytes per device live at one program point: `constant_bytes` plus, for each (group,
    bytes-vector) term, the bytes of the strategy that group picks."""
    terms: tuple[tuple[int, np.ndarray], ...]
    constant_bytes: float
    folded: bool = False     # one term per group, each with min 0 and max > 0 (see `folded_point`)
    max_bytes: float = 0.0   # when folded: the most the point can reach


def folded_point(terms: dict[int, np.ndarray], constant_bytes: float) -> MemoryPoint:
    """A point already in presolve's form (per-group minimums moved into the constant, constant
    terms dropped), so every later solve reads it without folding it again."""
    const, out, top = float(constant_bytes), [], 0.0
    for g, b in terms.items():
        lo, hi = float(b.min()), float(b.max())
        const += lo
        if hi > lo:
            out.append((g, b - lo))
            top += hi - lo
    return MemoryPoint(terms=tuple(out), constant_bytes=const, folded=True,
                       max_bytes=const + top)


@dataclass(frozen=True, slots=True)
class PointRows:
    """Memory points as flat arrays, to price a choice at every point at once: term n (of
    point `term_point[n]`, group `term_group[n]`) has its bytes per strategy at
    `vals[first[n]:first[n] + k]`."""
    const: np.ndarray
    term_point: np.ndarray
    term_group: np.ndarray
    first: np.ndarray
    vals: np.ndarray

    @property
    def lens(self) -> np.ndarray:
        """Per term, its number of strategies."""
        return np.diff(np.append(self.first, self.vals.size))

    def usage(self, choice) -> np.ndarray:
        """Bytes per device at every point under `choice` (one strategy per group)."""
        picked = self.vals[self.first + np.asarray(choice, np.int64)[self.term_group]]
        return self.const + np.bincount(self.term_point, weights=picked,
                                        minlength=self.const.size)

    def _strategies(self) -> tuple[np.ndarray, np.ndarray]:
        """Per entry of `vals`: its term, and its strategy within that term."""
        term = np.repeat(np.arange(self.first.size), self.lens)
        return term, np.arange(self.vals.size) - self.first[term]

    def mixed_usage(self, weights: dict[int, np.ndarray]) -> np.ndarray:
        """Bytes per device at every point when group g takes strategy i with weight
        `weights[g][i]` (an LP relaxation's solution; a one-hot vector is a choice)."""
        term, strategy = self._strategies()
        start = np.zeros(int(self.term_group.max(initial=-1)) + 1, np.int64)
        flat, n = [], 0
        for g in np.unique(self.term_group).tolist():
            start[g], n = n, n + len(weights[g])
            flat.append(np.asarray(weights[g], float))
        flat = np.concatenate(flat) if flat else np.zeros(0)
        w = flat[start[self.term_group[term]] + strategy]
        return self.const + np.bincount(self.term_point[term], weights=self.vals * w,
                                        minlength=self.const.size)

    def summed_leanest(self, num_groups: int, extra: dict[int, np.ndarray] | None = None,
                       ) -> np.ndarray:
        """A choice with each group at the strategy whose bytes summed over every point are
        the fewest (0 for a group in no point), with `extra[g][i]` more at every point (as
        `with_extra_bytes` adds them): a lean plan found without a solve, so its peak bounds
        the least peak from above."""
        extra = extra or {}
        lens = self.lens
        width = int(max([int(lens.max(initial=1))] + [v.size for v in extra.values()]))
        ks = np.zeros(num_groups, np.int64)
        ks[self.term_group] = lens
        total = np.zeros((num_groups, width))
        if self.vals.size:
            term, strategy = self._strategies()
            total += np.bincount(self.term_group[term] * width + strategy, weights=self.vals,
                                 minlength=num_groups * width).reshape(num_groups, width)
        for g, vec in extra.items():
            ks[g] = vec.size
            total[g, :vec.size] += self.const.size * np.asarray(vec, float)
        total[np.arange(width)[None, :] >= ks[:, None]] = np.inf
        return np.argmin(total, axis=1)


def lean_least(rows: PointRows, num_groups: int, extra: dict[int, np.ndarray] | None = None,
               ) -> tuple[float, np.ndarray] | None:
    """(the least peak, a choice attaining it) of the folded points `rows`, with `extra[g][i]`
    bytes more at every point where group g picks i (`with_extra_bytes`' points, not built: a
    whole stage's take seconds to fold), where the plan of `summed_leanest` leaves every
    point at its floor (its constant plus each extra's least: a lower bound of every plan's
    peak); else None, and only a solve knows."""
    if not rows.const.size:
        return None
    extra = extra or {}
    lean = rows.summed_leanest(num_groups, extra)
    held = sum((float(v[lean[g]]) for g, v in extra.items()), 0.0)
    floor = float(rows.const.max()) + sum((float(np.min(v)) for v in extra.values()), 0.0)
    peak = float(rows.usage(lean).max()) + held
    return (peak, lean) if peak <= floor else None


_POINT_ROWS: dict[int, tuple[tuple, PointRows]] = {}   # id(points) -> (points, rows)


def point_rows(points: tuple[MemoryPoint, ...]) -> PointRows:
    """`points` as `PointRows` (the last few tuples' are cached: a stage's problem is solved
    at several budgets with the same points)."""
    hit = _POINT_ROWS.get(id(points))
    if hit is not None and hit[0] is points:
        return hit[1]
    terms = [(i, g, b) for i, p in enumerate(points) for g, b in p.terms]
    lens = np.fromiter((len(b) for _, _, b in terms), np.int64, len(terms))
    rows = PointRows(
        const=np.array([p.constant_bytes for p in points], float),
        term_point=np.fromiter((i for i, _, _ in terms), np.int64, len(terms)),
        term_group=np.fromiter((g for _, g, _ in terms), np.int64, len(terms)),
        first=np.cumsum(lens) - lens,
        vals=np.concatenate([np.asarray(b, float) for _, _, b in terms]) if terms
        else np.zeros(0))
    _remember(points, rows)
    return rows


def _remember(points: tuple[MemoryPoint, ...], rows: PointRows) -> None:
    if len(_POINT_ROWS) >= 8:
        _POINT_ROWS.pop(next(iter(_POINT_ROWS)))
    _POINT_ROWS[id(points)] = (points, rows)


def _fold_point(p: MemoryPoint, ks) -> tuple[float, dict[int, np.ndarray]]:
    """Sum repeated groups; fold single-strategy groups and per-term minimums into the constant."""
    if p.folded:
        return p.constant_bytes, dict(p.terms)
    merged: dict[int, np.ndarray] = {}
    for g, b in p.terms:
        merged[g] = merged[g] + np.asarray(b, float) if g in merged else np.array(b, float)
    const, terms = float(p.constant_bytes), {}
    for g, b in merged.items():
        const += float(b.min())
        if ks[g] > 1 and b.max() > b.min():
            terms[g] = b - b.min()
    return const, terms


def with_extra_bytes(problem, extra: dict[int, np.ndarray]):
    """The problem (an `ilp.IlpProblem`) with `extra[g][i]` bytes added to every memory point
    when group g picks strategy i (memory that is live at every point, e.g. optimizer state
    held elsewhere). A whole stage has thousands of points, each with hundreds of held
    groups: the terms are summed and folded as flat arrays (`fold_terms`)."""
    points = problem.memory_points
    if not points:
        return problem
    rows = point_rows(points)
    n, gs = len(points), sorted(extra)
    vecs = [np.asarray(extra[g], float) for g in gs]
    glens = np.array([v.size for v in vecs], np.int64)
    return replace(problem, memory_points=fold_terms(
        rows.const,
        np.concatenate([rows.term_point, np.repeat(np.arange(n), len(gs))]),
        np.concatenate([rows.term_group, np.tile(np.array(gs, np.int64), n)]),
        np.concatenate([rows.lens, np.tile(glens, n)]),
        np.concatenate([rows.vals, np.tile(np.concatenate(vecs) if vecs else np.zeros(0), n)])))


def fold_terms(const, term_point, term_group, lens, vals) -> tuple[MemoryPoint, ...]:
    """Points from flat terms (term n: bytes per strategy `vals[first[n]:first[n] + lens[n]]`
    of group `term_group[n]` at point `term_point[n]`; point i's constant `const[i]`): terms
    of one group at one point summed, then each folded as `folded_point` folds (its minimum
    into the constant, constant terms dropped). Their `PointRows` are cached, so pricing them
    costs no second pass. Terms of one group must have one length."""
    const = np.asarray(const, float)
    num = const.size
    term_point = np.asarray(term_point, np.int64)
    term_group, lens = np.asarray(term_group, np.int64), np.asarray(lens, np.int64)
    if not term_point.size:
        return tuple(folded_point({}, c) for c in const.tolist())
    first = np.cumsum(lens) - lens
    key = term_point * (int(term_group.max()) + 1) + term_group
    order = np.argsort(key, kind="stable")
    head = np.ones(order.size, bool)
    head[1:] = key[order][1:] != key[order][:-1]
    seg = np.empty(order.size, np.int64)
    seg[order] = np.cumsum(head) - 1
    heads = order[head]
    slens = lens[heads]
    if (lens != slens[seg]).any():
        bad = int(np.flatnonzero(lens != slens[seg])[0])
        raise ValueError(f"memory terms of group {int(term_group[bad])} at point "
                         f"{int(term_point[bad])} have {int(lens[bad])} and "
                         f"{int(slens[seg[bad]])} strategies; one group has one length")
    sfirst = np.cumsum(slens) - slens
    owner = np.repeat(np.arange(lens.size), lens)
    summed = np.bincount(sfirst[seg[owner]] + np.arange(owner.size) - first[owner],
                         weights=vals, minlength=int(slens.sum()))
    lo, hi = np.minimum.reduceat(summed, sfirst), np.maximum.reduceat(summed, sfirst)
    spoint, sgroup = term_point[heads], term_group[heads]
    base = const + np.bincount(spoint, weights=lo, minlength=num)
    keep = np.flatnonzero(hi > lo)
    top = base + np.bincount(spoint[keep], weights=(hi - lo)[keep], minlength=num)
    klens = slens[keep]
    kfirst = np.cumsum(klens) - klens
    owner = np.repeat(keep, klens)
    kvals = summed[sfirst[owner] + np.arange(owner.size) - np.repeat(kfirst, klens)] \
        - lo[owner]
    kpoint, kgroup = spoint[keep], sgroup[keep].tolist()
    views = [kvals[a:a + k] for a, k in zip(kfirst.tolist(), klens.tolist())]
    cut = np.searchsorted(kpoint, np.arange(num + 1)).tolist()
    points = tuple(
        MemoryPoint(terms=tuple(zip(kgroup[a:b], views[a:b])), constant_bytes=c, folded=True,
                    max_bytes=t)
        for a, b, c, t in zip(cut[:-1], cut[1:], base.tolist(), top.tolist()))
    _remember(points, PointRows(const=base, term_point=kpoint, term_group=sgroup[keep],
                                first=kfirst, vals=kvals))
    return points
