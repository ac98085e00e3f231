"""The MIP behind the intra-op ILP: the model built from numpy arrays, and the HiGHS (highspy)
and CBC (pulp) backends. No JAX here."""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autopar.core.enums import SolverBackend, SolveStatus
from autopar.core.errors import UnsupportedError
from autopar.intra_op.cbc import cbc_solve
from autopar.intra_op.reduced import _Reduced

logger = logging.getLogger(__name__)

# Optimality: the solver stops when its incumbent is within this fraction of its bound, on the
# problem's whole objective (the model carries the constant that the shift to min 0 removed as
# its objective offset, so the gap is the user's: of the predicted step time). Models with at
# most EXACT_MAX_BINARIES binary columns (which solve in milliseconds) are solved exactly, and
# so are those whose answer must be exact (`Mip.rel_gap`: the least peak memory).
MIP_REL_GAP = 1e-3
EXACT_REL_GAP = 1e-9
EXACT_MAX_BINARIES = 500
DIVE_MAX_STEPS = 32       # LP re-solves of the dive that finds the MIP's start
DIVE_SHARE = 0.25         # of the time limit the dive may take
_INTEGRAL_TOL = 1e-9
# HiGHS restarts its root (presolve again, cuts again) when reduced-cost fixing deactivates a
# share of the integer columns; on the memory-bound stage ILPs it restarted 3-4 times, each
# time redoing the root's cuts and sub-MIPs. Without restarts (benchmarks/results/ilp.md):
# the 70 distinct ILPs of tests/inter_op/test_stages.py's budget test 18.0 -> 9.5 s, 10
# GPT-39B stage ILPs 192 -> 136 s, the same objectives within the 0.1% gap.
MIP_ALLOW_RESTART = False
# HiGHS's RENS heuristic solves a sub-MIP at the root, and that sub-MIP's presolve does not
# watch the time limit: on a GPT-39B layer ILP (K=8, M=1024, (2, 8) as (1, 16), selective
# recomputation; 3799 columns) highspy 1.16 stayed in `HPresolve::strengthenInequalities`
# under RENS for more than 7 minutes with a 60 s limit, while without RENS the MIP is solved
# to optimality in 2.6 s (tests/intra_op/test_mip.py). RENS off costs nothing measurable on
# the captured ILPs (benchmarks/results/ilp.md).
MIP_RUN_RENS = False
# The same presolve (`strengthenInequalities`) ran for more than 10 minutes, with a 60 s limit,
# in the sub-MIP of HiGHS's root-reduced-cost heuristic (`rootReducedCost` -> `solveSubMip`)
# on a layer ILP of GPT-39B K=8 M=128 with the default 2-D views (the stage search never
# finished). Off: on the 18 captured ILPs of that search (benchmarks/results/ilp.md) the same
# objectives, 137 against 139 CPU s.
MIP_RUN_ROOT_REDUCED_COST = False
# HiGHS strong-branches on a column until its pseudo-costs rest on this many branchings
# (its default: 8). On the memory-bound layer ILPs across hosts of GPT-39B (K=8, M=128; 12
# captured, 2-21 s each) 0 took 104.8 -> 77.1 s in all (p0001 10.6 -> 5.7 s), the same
# objectives within the 0.1% gap; on 91 captures of GPT-39B K=16 M=64 and make bench's GPT
# 84.2 -> 80.5 s (benchmarks/results/gpt39b.md).
MIP_MIN_RELIABLE = 0
# The LP relaxation with memory rows by the interior-point method (with crossover, so the
# dive re-solves from a basis) where it has at least LP_IPM_MIN_COLUMNS columns: on GPT-39B
# layer ILPs of a (1, 8) submesh as (2, 4) (73k columns, 32 memory rows) 4.3 s against 8.8 s
# by dual simplex; without memory rows the simplex is the faster (1.8 s against 2.9 s), and
# on the 6k-column ILPs of the same search IPM gained nothing (2.5 against 2.2 CPU s).
LP_IPM_WITH_MEMORY_ROWS = True
LP_IPM_MIN_COLUMNS = 20_000
_MIP_ABS_GAP = 1e-10


# ----------------------------------------------------------------------------- the MIP model

class Mip:
    """min cost.x s.t. row_lower <= A x <= row_upper, lower <= x <= upper (A in COO form), built
    from numpy chunks; local and mutable until `freeze()` concatenates them into arrays."""

    def __init__(self):
        self._cols, self._rows, self._nz, self.num_cols, self.num_rows = [], [], [], 0, 0
        self.group_cols: list[tuple[int, int, int]] = []    # (group, first column, k)
        # (u, v, first column, class of each u strategy, class of each v strategy, classes of v)
        self.edge_cols: list[tuple[int, int, int, np.ndarray, np.ndarray, int]] = []
        self.offset = 0.0                    # objective constant (in the model's units)
        self.scale = 1.0                     # seconds per unit of the model's objective
        self.start: np.ndarray | None = None    # a feasible column vector to start from
        self.rel_gap: float | None = None     # None: by size (see MIP_REL_GAP)
        # LP solution -> a feasible column vector rounded from it, or None (`solve_highs`)
        self.rounding: Callable[[np.ndarray], np.ndarray | None] | None = None

    def add_cols(self, cost, *, integer: bool, lower: float = 0.0, upper: float = 1.0) -> int:
        n = np.size(cost)
        self._cols.append((np.asarray(cost, float), np.full(n, lower), np.full(n, upper),
                           np.full(n, integer)))
        self.num_cols += n
        return self.num_cols - n

    def add_rows(self, n: int, lower: float, upper: float) -> int:
        self._rows.append((np.full(n, lower), np.full(n, upper)))
        self.num_rows += n
        return self.num_rows - n

    def add_entries(self, rows, cols, vals) -> None:
        rows = np.broadcast_to(rows, np.shape(cols))
        vals = np.broadcast_to(np.asarray(vals, float), rows.shape)
        self._nz.append((rows, np.asarray(cols), vals))

    def add_groups(self, groups, costs: dict[int, np.ndarray]) -> dict[int, int]:
        """Binary one-hot columns (sum = 1) per group; returns each group's first column."""
        off = {}
        for g in groups:
            off[g] = self.add_cols(costs[g], integer=True)
            self.group_cols.append((g, off[g], costs[g].size))
            self.add_entries(self.add_rows(1, 1.0, 1.0), off[g] + np.arange(costs[g].size), 1.0)
        return off

    def add_bytes(self, row0: int, rows_terms, off: dict[int, int], scale) -> None:
        """Row `row0 + r` gets bytes[g][i] / scale on group g's column i for each term (g,
        bytes) of `rows_terms[r]` (zeros left out); `scale`: one number or one per row."""
        self.add_flat(row0, _flat_terms(rows_terms, off), np.broadcast_to(scale, len(rows_terms)))

    def add_flat(self, row0: int, flat, scale: np.ndarray) -> None:
        """`add_bytes` of terms already flat (`_flat_terms`), `scale` one number per row."""
        at, col, vals = flat
        nz = vals != 0
        self.add_entries(row0 + at[nz], col[nz], vals[nz] / scale[at[nz]])

    def freeze(self) -> Mip:
        self.cost, self.lower, self.upper, self.integer = map(np.concatenate, zip(*self._cols))
        self.row_lower, self.row_upper = map(np.concatenate, zip(*self._rows))
        self.rows, self.cols, self.vals = map(np.concatenate, zip(*self._nz))
        self.rows, self.cols = self.rows.astype(np.int64), self.cols.astype(np.int64)
        return self


def build_mip(red: _Reduced, reps: dict[int, np.ndarray] | None = None) -> Mip:
    """The reduced ILP, with node and edge costs shifted to min 0 and normalized to max 1 (the
    shift is the model's objective offset). `reps` (`heuristics.dominators`): the columns of
    dominated strategies are fixed to 0."""
    costs = {g: red.node_costs[g] - red.node_costs[g].min() for g in red.var_groups}
    mats = [r - r.min() for _, _, r in red.edges]
    scale = max([float(c.max()) for c in costs.values()] + [float(m.max()) for m in mats] + [0.0])
    scale = scale if scale > 0 else 1.0
    mip = Mip()
    mip.scale = scale
    mip.offset = (sum(float(red.node_costs[g][i]) for g, i in enumerate(red.choice) if i >= 0)
                  + sum(float(red.node_costs[g].min()) for g in red.var_groups)
                  + sum(float(r.min()) for _, _, r in red.edges)) / scale
    off = mip.add_groups(red.var_groups, {g: c / scale for g, c in costs.items()})
    _edge_columns(mip, red.edges, mats, off, scale)
    if red.mem_rows:
        _memory_rows(mip, red.mem_rows, off)
    mip.freeze()
    for g, rep in (reps or {}).items():
        mip.upper[off[g] + np.flatnonzero(rep != np.arange(rep.size))] = 0.0
    return mip


def _edge_columns(mip: Mip, edges, mats, off: dict[int, int], scale: float) -> None:
    """Per edge (u, v) with cost matrix R (shifted to min 0): strategies that look the same
    across the edge (equal rows / columns of R) share edge variables, e[r, c] over row and
    column classes, with class marginals. Exact: with one-hot s_u and s_v the class marginals
    are one-hot, so e is their outer product. A layer's edges repeat in every layer like it:
    the entries of all edges of one matrix are made at once (columns and rows numbered in
    edge order, as one edge at a time would)."""
    classes: dict[tuple, list] = {}
    shapes, col0, row0 = [], mip.num_cols, mip.num_rows
    for n, m in enumerate(mats):
        key = (m.shape, m.tobytes())
        if key not in classes:
            uniq_rows, r_of = np.unique(m, axis=0, return_inverse=True)
            mc, c_of = np.unique(uniq_rows, axis=1, return_inverse=True)
            classes[key] = [mc, np.ravel(r_of), np.ravel(c_of), []]
        classes[key][3].append(n)
        shapes.append(classes[key])
    if not edges:
        return
    ncols = np.array([c[0].size for c in shapes], np.int64)
    nrows = np.array([sum(c[0].shape) - 1 for c in shapes], np.int64)   # the last column
    e0s = col0 + np.cumsum(ncols) - ncols                                # sum is implied
    r0s = row0 + np.cumsum(nrows) - nrows
    mip.add_cols(np.concatenate([c[0].ravel() for c in shapes]) / scale, integer=False)
    mip.add_rows(int(nrows.sum()), 0.0, 0.0)
    for (u, v, _), c, e0 in zip(edges, shapes, e0s.tolist()):
        mip.edge_cols.append((u, v, e0, c[1], c[2], c[0].shape[1]))
    for mc, r_of, c_of, which in classes.values():
        nr, ncl = mc.shape
        e0, r0 = e0s[which][:, None], r0s[which][:, None]
        us = np.array([off[edges[n][0]] for n in which])[:, None]
        vs = np.array([off[edges[n][1]] for n in which])[:, None]
        r_idx, c_idx = np.divmod(np.arange(nr * ncl), ncl)
        keep, keep_v = np.flatnonzero(c_idx < ncl - 1), np.flatnonzero(c_of < ncl - 1)
        mip.add_entries((r0 + r_idx).ravel(), (e0 + np.arange(nr * ncl)).ravel(), 1.0)
        mip.add_entries((r0 + r_of).ravel(), (us + np.arange(r_of.size)).ravel(), -1.0)
        mip.add_entries((r0 + nr + c_idx[keep]).ravel(), (e0 + keep).ravel(), 1.0)
        mip.add_entries((r0 + nr + c_of[keep_v]).ravel(), (vs + keep_v).ravel(), -1.0)


def _flat_terms(rows_terms, off: dict[int, int]):
    """(row, column, value) per coefficient of the terms (g, bytes) of each row, as arrays."""
    row_of, cols, vecs = [], [], []
    for r, terms in enumerate(rows_terms):
        for g, vec in terms:
            row_of.append(r), cols.append(off[g]), vecs.append(vec)
    if not vecs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    lens = np.fromiter(map(len, vecs), np.int64, len(vecs))
    first = np.cumsum(lens) - lens
    return (np.repeat(np.array(row_of, np.int64), lens),
            np.repeat(np.array(cols, np.int64) - first, lens) + np.arange(int(lens.sum())),
            np.concatenate(vecs).astype(float))


def _memory_rows(mip: Mip, rows, off: dict[int, int]) -> None:
    """One row per memory row (terms, rhs): sum of bytes[g][i] * s[g, i] <= rhs, each row
    scaled by its largest coefficient or |rhs| (at least 1)."""
    rhs = np.array([b for _, b in rows], float)
    top = np.maximum(np.abs(rhs), 1.0)
    flat = _flat_terms([t for t, _ in rows], off)
    np.maximum.at(top, flat[0], flat[2])
    mip.add_flat(mip.add_rows(len(rows), -np.inf, rhs / top), flat, top)


# ----------------------------------------------------------------------------- backends

@dataclass(frozen=True, slots=True, kw_only=True)
class MipResult:
    kind: SolveStatus          # OPTIMAL, FEASIBLE, FALLBACK (no solution) or INFEASIBLE
    x: np.ndarray | None
    reason: str                # why it stopped early ("" when optimal)
    gap: float | None = None


def _dive(h, mip: Mip, x: np.ndarray, deadline: float) -> np.ndarray | None:
    """An LP dive: fix the *last* fractional group (in model order: the end of the step, the
    backward pass and the update) to its largest column, re-solve the LP warm, and repeat
    until it is integral. The edge LP's optimum mixes two plans half and half around the
    cycle the parameter update closes; fixing a group there usually makes the rest integral
    (2 to 4 LPs on the GPTs of the demo and `make bench`, within 0.1% of the optimum). The
    integral LP point is a feasible plan; None where the dive fails (infeasible, time)."""
    import highspy
    for _ in range(DIVE_MAX_STEPS):
        frac = [(s, k) for _, s, k in mip.group_cols
                if 1.0 - float(x[s:s + k].max()) > _INTEGRAL_TOL]
        if not frac:
            return x
        if time.perf_counter() > deadline:
            return None
        s, k = frac[-1]
        upper = np.zeros(k)
        upper[int(np.argmax(x[s:s + k]))] = 1.0
        h.changeColsBounds(k, np.arange(s, s + k, dtype=np.int32), mip.lower[s:s + k], upper)
        h.setOptionValue("time_limit", max(deadline - time.perf_counter(), 1e-3))
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        x = np.asarray(h.getSolution().col_value)
    return None


def _rel_gap(mip: Mip) -> float:
    if mip.rel_gap is not None:
        return mip.rel_gap
    return MIP_REL_GAP if int(mip.integer.sum()) > EXACT_MAX_BINARIES else EXACT_REL_GAP


def _within_gap(mip: Mip, value: float, bound: float) -> bool:
    """Whether a plan of objective `value` is optimal within the MIP's gaps, `bound` (e.g. the
    LP relaxation's value) being a lower bound: HiGHS's own stopping test (model units)."""
    value, bound = value + mip.offset, bound + mip.offset
    return value - bound <= max(_rel_gap(mip) * abs(value), _MIP_ABS_GAP)


def _quiet_highs():
    """A `highspy.Highs()` without the banner its constructor writes to the process's stdout
    (file descriptor 1, below Python: `output_flag` can only be set after it, and `logging`
    cannot filter it). Output of other threads in the same microseconds is lost with it."""
    import highspy
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _highs(mip: Mip, time_limit_s: float, *, relaxed: bool):
    """A HiGHS instance holding the model (its LP relaxation where `relaxed`)."""
    import highspy
    h = _quiet_highs()
    for name, value in (("output_flag", False), ("time_limit", float(time_limit_s)),
                        ("mip_rel_gap", _rel_gap(mip)), ("mip_abs_gap", _MIP_ABS_GAP),
                        ("mip_allow_restart", MIP_ALLOW_RESTART),
                        ("mip_heuristic_run_rens", MIP_RUN_RENS),
                        ("mip_heuristic_run_root_reduced_cost", MIP_RUN_ROOT_REDUCED_COST),
                        ("mip_pscost_minreliable", MIP_MIN_RELIABLE)):
        h.setOptionValue(name, value)
    n, m = mip.cost.size, mip.row_lower.size
    order = np.lexsort((mip.rows, mip.cols))
    start = np.zeros(n + 1, dtype=np.int32)
    start[1:] = np.cumsum(np.bincount(mip.cols, minlength=n))
    integrality = np.zeros(n, dtype=np.int32) if relaxed else mip.integer.astype(np.int32)
    status = h.passModel(n, m, len(order), int(highspy.MatrixFormat.kColwise),
                         int(highspy.ObjSense.kMinimize), float(mip.offset), mip.cost,
                         mip.lower, mip.upper, mip.row_lower, mip.row_upper, start,
                         mip.rows[order].astype(np.int32), mip.vals[order], integrality)
    if status == highspy.HighsStatus.kError:
        raise RuntimeError("HiGHS rejected the model (passModel returned kError)")
    return h


def solve_highs(mip: Mip, time_limit_s: float) -> MipResult:
    """Solve with HiGHS: the LP relaxation first, which is the answer where it comes out
    integral (often, e.g. where no memory row binds: then no branch and bound runs), or where
    its rounding (`mip.rounding`) is within the gap of its bound; else an LP dive (`_dive`)
    gives a plan, and the MIP starts from the best of it, the rounding and `mip.start`."""
    import highspy
    t0 = time.perf_counter()
    status_enum = highspy.HighsModelStatus
    h = _highs(mip, time_limit_s, relaxed=True)
    ipm = (LP_IPM_WITH_MEMORY_ROWS and mip.cost.size >= LP_IPM_MIN_COLUMNS
           and bool(np.any(np.isinf(mip.row_lower))))
    if ipm:
        h.setOptionValue("solver", "ipm")
    h.run()
    if ipm:
        h.setOptionValue("solver", "simplex")     # the dive's re-solves start from the basis
    if h.getModelStatus() == status_enum.kInfeasible:
        return MipResult(kind=SolveStatus.INFEASIBLE, x=None, reason="infeasible")
    start = mip.start
    if h.getModelStatus() == status_enum.kOptimal:
        x = np.asarray(h.getSolution().col_value)
        if is_integral(mip, x):
            return MipResult(kind=SolveStatus.OPTIMAL, x=x, reason="")
        rounded = mip.rounding(x) if mip.rounding is not None else None
        if rounded is not None:
            if _within_gap(mip, float(mip.cost @ rounded), float(mip.cost @ x)):
                return MipResult(kind=SolveStatus.OPTIMAL, x=rounded, reason="")
            if start is None or mip.cost @ rounded < mip.cost @ start:
                start = rounded
        dived = _dive(h, mip, x, t0 + DIVE_SHARE * time_limit_s)
        if dived is not None and (start is None or mip.cost @ dived < mip.cost @ start):
            start = dived
    h = _highs(mip, max(time_limit_s - (time.perf_counter() - t0), 1e-3), relaxed=False)
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value, sol.value_valid = [float(v) for v in start], True
        h.setSolution(sol)
    h.run()
    ms, info = h.getModelStatus(), h.getInfo()
    if ms == status_enum.kOptimal:
        x = np.asarray(h.getSolution().col_value)
        return MipResult(kind=SolveStatus.OPTIMAL, x=x, reason="")
    if ms in (status_enum.kInfeasible, status_enum.kUnboundedOrInfeasible):
        return MipResult(kind=SolveStatus.INFEASIBLE, x=None, reason="infeasible")
    reason = (f"time limit {time_limit_s:g} s hit" if ms == status_enum.kTimeLimit
              else f"HiGHS stopped early ({h.modelStatusToString(ms)})")
    if info.primal_solution_status == int(highspy.SolutionStatus.kSolutionStatusFeasible):
        return MipResult(kind=SolveStatus.FEASIBLE, x=np.asarray(h.getSolution().col_value),
                          reason=reason, gap=float(info.mip_gap))
    return MipResult(kind=SolveStatus.FALLBACK, x=None, reason=reason)


def solve_cbc(mip: Mip, time_limit_s: float) -> MipResult:
    import pulp

    prob = pulp.LpProblem("autopar_intra_op", pulp.LpMinimize)
    xs = [prob.add_variable(f"x{i}", None if lo == -np.inf else lo, None if hi == np.inf else hi,
                            cat=pulp.LpInteger if integer else pulp.LpContinuous)
          for i, (lo, hi, integer) in enumerate(zip(mip.lower, mip.upper, mip.integer))]
    nz = np.flatnonzero(mip.cost)   # lpDot: PuLP 4 builds expressions differently from 3
    prob += pulp.lpDot([float(c) for c in mip.cost[nz]], [xs[i] for i in nz]) + mip.offset
    order = np.argsort(mip.rows, kind="stable")
    bounds = np.cumsum(np.bincount(mip.rows, minlength=mip.row_lower.size))[:-1]
    for r, (cols, vals) in enumerate(zip(np.split(mip.cols[order], bounds),
                                         np.split(mip.vals[order], bounds))):
        expr = pulp.lpDot([float(v) for v in vals], [xs[c] for c in cols])
        rhs = float(mip.row_upper[r])
        prob += (expr == rhs) if mip.row_lower[r] == mip.row_upper[r] else (expr <= rhs)
    status, words = cbc_solve(prob, msg=False, timeLimit=time_limit_s, gapRel=_rel_gap(mip),
                              gapAbs=_MIP_ABS_GAP)
    if status is SolveStatus.INFEASIBLE:
        return MipResult(kind=status, x=None, reason="infeasible")
    x = np.array([v.varValue or 0.0 for v in xs])
    if status is SolveStatus.OPTIMAL:
        return MipResult(kind=status, x=x, reason="")
    reason = f"time limit {time_limit_s:g} s hit"
    if status is SolveStatus.FEASIBLE:
        return MipResult(kind=status, x=x, reason=reason)
    return MipResult(kind=status, x=None, reason=f"{reason} (CBC status {words})")


def run_mip(mip: Mip, backend: SolverBackend, time_limit_s: float) -> MipResult:
    """Run a backend; any exception becomes a FALLBACK result (logged), never propagates, but
    an UnsupportedError (the backend asked for is not installed)."""
    try:
        solve = solve_highs if backend is SolverBackend.HIGHS else solve_cbc
        return solve(mip, time_limit_s)
    except UnsupportedError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a solver failure must not kill the compile
        logger.warning("%s solver failed (%s: %s); using a greedy plan", backend.value,
                       type(exc).__name__, exc)
        return MipResult(kind=SolveStatus.FALLBACK, x=None,
                         reason=f"{backend.value} failed ({type(exc).__name__}: {exc})")


def is_integral(mip: Mip, x: np.ndarray, tol: float = _INTEGRAL_TOL) -> bool:
    """Whether every group's columns in `x` are one-hot (then so are the edge columns: their
    marginals are one-hot)."""
    v = x[mip.integer]
    return bool(np.all(np.minimum(np.abs(v), np.abs(1.0 - v)) <= tol))


def columns_of(mip: Mip, choice) -> np.ndarray:
    """The model's column vector of an integral choice (a group's strategy column is 1, and on
    each edge the column of the pair of classes the two choices fall in)."""
    x = np.zeros(mip.cost.size)
    for g, start, _ in mip.group_cols:
        x[start + choice[g]] = 1.0
    for u, v, e0, r_of, c_of, ncl in mip.edge_cols:
        x[e0 + r_of[choice[u]] * ncl + c_of[choice[v]]] = 1.0
    return x


def round_solution(mip: Mip, x: np.ndarray, choice: np.ndarray) -> np.ndarray:
    """Argmax per group of the solver's column values, written into a copy of `choice`."""
    choice = choice.copy()
    for g, start, k in mip.group_cols:
        choice[g] = int(np.argmax(x[start:start + k]))
    return choice
