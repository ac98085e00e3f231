"""The intra-op ILP (Alpa §4) over *variable groups*: presolve, HiGHS / CBC, greedy fallback.

Each group g picks one of k_g strategies (binary one-hot s_g). Each edge (u, v) carries a
resharding-cost matrix R (k_u x k_v) linearized through continuous e_uv in [0, 1] whose row sums
equal s_u and column sums equal s_v (exact because s is binary). Memory points bound the bytes
per device of the chosen strategies. This module imports no `jax`: it is numbers only.

OPTIMAL means within `mip.MIP_REL_GAP` (0.1%) of the optimum of the whole objective for
models of more than `mip.EXACT_MAX_BINARIES` binary columns, exact for smaller ones. Dominated
strategies (`heuristics.dominators`) are left out; a solve starts from the best of the greedy
plan, the caller's hint, the LP solution rounded to fit (`heuristics.lp_rounded`; the answer
where within the gap of the LP bound) and an LP dive (`mip.solve_highs`), and the same
problem gives the same plan run to run.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import numpy as np

from autopar.core.enums import SolverBackend
from autopar.core.errors import InvalidArgumentError
from autopar.intra_op.heuristics import dominators, greedy, rounded_columns, undominated_choice
from autopar.intra_op.memory_points import (  # noqa: F401
    MemoryPoint,
    PointRows,
    _fold_point,
    folded_point,
    lean_least,
    point_rows,
    with_extra_bytes,
)
from autopar.intra_op.mip import (
    EXACT_REL_GAP,
    Mip,
    MipResult,
    SolveStatus,
    build_mip,
    columns_of,
    is_integral,
    round_solution,
    run_mip,
)
from autopar.intra_op.reduced import _presolve, _Reduced

logger = logging.getLogger(__name__)

_BRUTE_FORCE_LIMIT = 200_000


@dataclass(frozen=True, slots=True, kw_only=True)
class IlpEdge:
    """Resharding cost between groups u and v: `cost[i, j]` seconds if u picks i and v picks j."""
    u: int
    v: int
    cost: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class IlpProblem:
    """Node costs per group, edge cost matrices, and optional memory points with a budget.
    Validated at construction."""
    node_costs: tuple[np.ndarray, ...]
    edges: tuple[IlpEdge, ...]
    memory_points: tuple[MemoryPoint, ...] = ()
    memory_budget_bytes: float | None = None

    def __post_init__(self):
        # Messages are formatted only on failure: this runs over every term of every point.
        ks = self.num_strategies
        for g, c in enumerate(self.node_costs):
            if not (np.ndim(c) == 1 and ks[g] >= 1 and np.isfinite(c).all()):
                _require(False, f"node_costs[{g}] must be a non-empty 1-D vector of finite "
                         f"seconds; got shape {np.shape(c)}. Forbid a strategy with a large "
                         f"finite cost, not inf.")
        for n, e in enumerate(self.edges):
            if not (0 <= e.u < len(ks) and 0 <= e.v < len(ks) and e.u != e.v):
                _require(False, f"edges[{n}] joins groups ({e.u}, {e.v}); it needs two "
                         f"different groups of the {len(ks)} (fold a self-edge's diagonal into "
                         f"the node cost).")
            if not (np.shape(e.cost) == (ks[e.u], ks[e.v]) and np.isfinite(e.cost).all()):
                _require(False, f"edges[{n}].cost must be finite with shape (k_u, k_v) = "
                         f"{(ks[e.u], ks[e.v])}; got shape {np.shape(e.cost)}.")
        for n, p in enumerate(self.memory_points):
            if p.folded:     # made by `folded_point` or the builder from checked vectors
                continue
            for g, b in p.terms:
                if not (0 <= g < len(ks) and len(b) == ks[g]):
                    _require(False, f"memory_points[{n}] has a term for group {g} with shape "
                             f"{np.shape(b)}; it needs bytes, one per strategy of an existing "
                             f"group.")
        _require(self.memory_budget_bytes is None or math.isfinite(self.memory_budget_bytes),
                 f"memory_budget_bytes must be finite or None; got {self.memory_budget_bytes}.")

    @property
    def num_strategies(self) -> tuple[int, ...]:
        """k_g per group."""
        return tuple(int(np.size(c)) for c in self.node_costs)


@dataclass(frozen=True, slots=True, kw_only=True)
class IlpSolution:
    """A strategy per group, its exact objective (`evaluate`), and how it was found."""
    choice: tuple[int, ...]
    objective: float
    status: SolveStatus
    backend: SolverBackend | None      # None: no solver ran (trivial problem, brute force)
    solve_time_s: float
    num_variables: int                 # of the model given to the solver, after presolve
    num_constraints: int
    message: str


def evaluate(problem: IlpProblem, choice) -> float:
    """Sum of chosen node costs and chosen edge costs, in seconds."""
    c = _check_choice(problem, choice)
    total = math.fsum(float(problem.node_costs[g][c[g]]) for g in range(len(c)))
    return total + math.fsum(float(e.cost[c[e.u], c[e.v]]) for e in problem.edges)


def _relaxed(mip: Mip, time_limit_s: float) -> np.ndarray | None:
    """The optimal solution of `mip`'s LP relaxation by HiGHS (None where it has none)."""
    integer, mip.integer = mip.integer, np.zeros_like(mip.integer)
    try:
        res = run_mip(mip, SolverBackend.HIGHS, time_limit_s)
    finally:
        mip.integer = integer
    return res.x if res.kind is SolveStatus.OPTIMAL else None


def peak_memory_bytes(problem: IlpProblem, choice) -> float:
    """Max over memory points of the bytes per device under `choice` (0 without memory points)."""
    c = _check_choice(problem, choice)
    if not problem.memory_points:
        return 0.0
    return float(point_rows(problem.memory_points).usage(c).max())


def _require(ok, message: str) -> None:
    if not ok:
        raise InvalidArgumentError(message)


def _check_choice(problem: IlpProblem, choice) -> tuple[int, ...]:
    c, ks = tuple(int(i) for i in choice), problem.num_strategies
    _require(len(c) == len(ks) and all(0 <= i < k for i, k in zip(c, ks)),
             f"choice {c} must give one index in [0, k_g) per group; the groups have k = {ks}.")
    return c



def _check_args(backend, time_limit_s) -> None:
    _require(isinstance(backend, SolverBackend),
             f"backend must be a SolverBackend (HIGHS or CBC); got {backend!r}.")
    _require(time_limit_s > 0, f"time_limit_s must be > 0; got {time_limit_s}.")


def _rank(problem: IlpProblem, choice) -> tuple[bool, float]:
    """Sort key for candidate plans: within budget first, then cheaper."""
    budget = problem.memory_budget_bytes
    over = budget is not None and peak_memory_bytes(problem, choice) > budget
    return over, evaluate(problem, choice)


LAZY_MEMORY_POINTS = 64    # above this many liveness points, add them as they are violated
LAZY_BATCH = 32    # points added per round: 4 GPT-39B layer ILPs (~270 points each, 1 x 32 and
                   # 1 x 64 views) took 11 s in all instead of 30 s with 16 (2 rounds instead of
                   # 2-5, each a MIP); the answer is the same (the rounds are exact)


def solve_ilp(problem: IlpProblem, *, backend: SolverBackend = SolverBackend.HIGHS,
              time_limit_s: float = 60.0, hint=None) -> IlpSolution:
    """Solve the ILP. Many memory points are added lazily (exact): solve with the points added
    so far, add the most violated of the rest, and repeat until the plan fits every point. The
    first MIP starts with the points its LP relaxation needs (`_lp_points`), so one MIP
    usually suffices, and none where that LP is integral. `hint`: a choice to start from
    (where it fits)."""
    points, budget = problem.memory_points, problem.memory_budget_bytes
    if budget is None or len(points) <= LAZY_MEMORY_POINTS:
        return _solve_once(problem, backend=backend, time_limit_s=time_limit_s, hint=hint)
    t0 = time.perf_counter()
    rows = point_rows(points)
    active, exact = (_lp_points(problem, rows, time_limit_s)
                     if backend is SolverBackend.HIGHS else ([], None))
    if exact is not None:
        return exact
    rounds, sol = 0, None
    while True:
        remaining = max(time_limit_s - (time.perf_counter() - t0), 1e-3)
        sub = replace(problem, memory_points=tuple(points[i] for i in active))
        sol = _solve_once(sub, backend=backend, time_limit_s=remaining, least_memory=False,
                          hint=hint if sol is None else sol.choice)
        rounds += 1
        if sol.status is SolveStatus.INFEASIBLE:   # a subset is infeasible, so is the whole
            need, choice = min_peak_memory(problem, backend=backend, time_limit_s=time_limit_s)
            sol = replace(sol, choice=tuple(choice), objective=evaluate(problem, choice))
            break
        usage = rows.usage(sol.choice)
        taken = set(active)
        over = [int(i) for i in np.argsort(-usage) if usage[i] > budget and int(i) not in taken]
        if not over or sol.status is not SolveStatus.OPTIMAL:
            if over:
                sol = replace(sol, message=f"{sol.message}; this plan needs {usage.max():.6g} "
                              f"bytes, over the budget of {budget:.6g}")
            break
        active.extend(over[:LAZY_BATCH])
    return replace(sol, solve_time_s=time.perf_counter() - t0,
                   message=f"{sol.message}; memory: {len(active)} of {len(points)} liveness "
                           f"constraints needed ({rounds} solve{'s' * (rounds > 1)})")


LP_POINTS_MAX_COLUMNS = 20_000   # larger LPs cost as much as the MIP round they would spare
LP_POINTS_MARGIN = 0.05   # and the points the LP fills within this fraction of the budget


@dataclass(frozen=True, slots=True)
class RowLp:
    """The last round of `lp_rounds`: the presolved problem, its LP (None where presolve fixed
    every group) and the LP's solution, and every point's bytes under it (None without rows)."""
    red: _Reduced
    mip: Mip | None
    x: np.ndarray | None
    usage: np.ndarray | None


def lp_rounds(problem: IlpProblem, rows: PointRows | None, deadline: float = math.inf,
              max_columns: int | None = None) -> tuple[RowLp | None, list[int]]:
    """The LP relaxation of `problem` with its memory points (`rows`; None: without them)
    joining as the LP breaks them, the most violated `LAZY_BATCH` per round, until it breaks
    none: (that round, exactly the LP with every row; the points in it). (None, the points
    so far) where it stops first: no fractional plan fits (presolve, or an LP without a
    solution), an LP has more than `max_columns` columns, or `deadline` passes (without one,
    each LP gets 60 s)."""
    budget, active = problem.memory_budget_bytes, []
    while time.perf_counter() < deadline:
        red = _presolve(replace(problem, memory_points=tuple(
            problem.memory_points[i] for i in active)))
        if red.infeasible:
            break
        mip = x = None
        if red.var_groups:
            mip = build_mip(red)
            if max_columns is not None and mip.cost.size > max_columns:
                break
            x = _relaxed(mip, 60.0 if deadline == math.inf
                         else max(deadline - time.perf_counter(), 1e-3))
            if x is None:
                break
        if rows is None:
            return RowLp(red, mip, x, None), active
        weights = {g: np.eye(k)[red.choice[g]] if red.choice[g] >= 0 else None
                   for g, k in enumerate(problem.num_strategies)}
        for g, s0, k in (mip.group_cols if mip is not None else ()):
            weights[g] = x[s0:s0 + k]
        usage = rows.mixed_usage(weights)
        over = _fullest(usage, active, budget * (1 + 1e-9))
        if not over:
            return RowLp(red, mip, x, usage), active
        active = active + over
    return None, active


def _fullest(usage: np.ndarray, active, threshold: float) -> list[int]:
    """Up to `LAZY_BATCH` memory points not in `active` whose bytes (`usage`) exceed
    `threshold`, the fullest first: the rows a lazy round adds."""
    rest = usage.copy()
    rest[active] = -np.inf
    over = np.flatnonzero(rest > threshold)
    return [int(i) for i in over[np.argsort(-rest[over])][:LAZY_BATCH]]


def _lp_points(problem: IlpProblem, rows: PointRows,
               time_limit_s: float) -> tuple[list[int], IlpSolution | None]:
    """The memory points the first MIP of `solve_ilp` starts with: those the LP relaxation
    needs (`lp_rounds`), then those it fills within `LP_POINTS_MARGIN` of the budget, which an
    integral plan near it often breaks. An LP costs a fraction of a MIP, so the lazy rounds'
    MIPs (each solved to optimality only to find its plan over a point not yet added) mostly
    vanish. The points so far where the LP is large (`LP_POINTS_MAX_COLUMNS`) or does not
    solve. Returns (the points, the solution where the LP's is integral and fits every
    point: then it is the optimum, and no MIP is needed)."""
    t0, budget = time.perf_counter(), problem.memory_budget_bytes
    lp, active = lp_rounds(problem, rows, t0 + 0.25 * time_limit_s, LP_POINTS_MAX_COLUMNS)
    if lp is None:
        return active, None
    if (lp.mip is None or is_integral(lp.mip, lp.x)) and lp.usage.max() <= budget:
        choice = lp.red.choice if lp.mip is None else round_solution(lp.mip, lp.x, lp.red.choice)
        return active, _lp_solution(problem, choice, lp.mip, active, time.perf_counter() - t0)
    return active + _fullest(lp.usage, active, budget * (1 - LP_POINTS_MARGIN)), None


def _lp_solution(problem: IlpProblem, choice, mip: Mip | None, active, took: float,
                 ) -> IlpSolution:
    """The plan of an integral LP solution that fits every memory point (`_lp_points`)."""
    choice = tuple(int(i) for i in choice)
    n_var, n_con = (0, 0) if mip is None else (mip.cost.size, mip.row_lower.size)
    logger.info("intra-op ILP: optimal in %.3f s (%d groups -> %d variables, %d constraints; "
                "the LP relaxation is integral)", took, len(problem.node_costs), n_var, n_con)
    return IlpSolution(choice=choice, objective=evaluate(problem, choice),
                       status=SolveStatus.OPTIMAL,
                       backend=None if mip is None else SolverBackend.HIGHS, solve_time_s=took,
                       num_variables=n_var, num_constraints=n_con,
                       message=f"optimal (the LP relaxation is integral and fits all "
                               f"{len(problem.memory_points)} liveness constraints; "
                               f"{len(active)} of them in the LP)")


def _start(problem: IlpProblem, red: _Reduced, reps, mip: Mip, hint) -> np.ndarray | None:
    """The MIP's start: the best of the greedy plan and the hint (improved), with dominated
    strategies replaced (the MIP has no such columns); None where neither fits the budget."""
    tries = [greedy(red)]
    if hint is not None:
        tries.append(greedy(red, np.where(red.choice >= 0, red.choice, np.asarray(hint)),
                            movable=red.var_groups))
    tries = [undominated_choice(c, reps) for c in tries]
    over, _, best = min((*_rank(problem, c), n) for n, c in enumerate(tries))
    return None if over else columns_of(mip, tries[best])


def _solve_once(problem: IlpProblem, *, backend: SolverBackend = SolverBackend.HIGHS,
                time_limit_s: float = 60.0, least_memory: bool = True,
                hint=None) -> IlpSolution:
    """Presolve, then solve the reduced ILP with `backend` within `time_limit_s` (solvers may
    overshoot), dominated strategies left out, from the best of the greedy plan and `hint` (a
    choice, e.g. the last round's, improved by local search) where it fits. An infeasible
    budget gives status INFEASIBLE with the minimum-peak-memory choice (this costs a second
    solve, skipped with `least_memory=False`, which gives the presolved choice instead); the
    caller decides what to raise."""
    _check_args(backend, time_limit_s)
    t0 = time.perf_counter()
    red = _presolve(problem)
    mip = None
    if red.var_groups and not red.infeasible:
        reps = dominators(red)
        mip = build_mip(red, reps)
        mip.start = _start(problem, red, reps, mip, hint)
        mip.rounding = lambda x: rounded_columns(red, reps, mip, x)
    n_var, n_con = (0, 0) if mip is None else (mip.cost.size, mip.row_lower.size)
    res = MipResult(kind=SolveStatus.INFEASIBLE if red.infeasible else SolveStatus.OPTIMAL,
                     x=None, reason="") if mip is None else run_mip(mip, backend, time_limit_s)
    if res.kind is SolveStatus.INFEASIBLE and not least_memory:
        choice, msg = greedy(red), "memory budget cannot be met"
    elif res.kind is SolveStatus.INFEASIBLE:
        need, choice = min_peak_memory(problem, backend=backend, time_limit_s=time_limit_s)
        choice = np.asarray(choice)
        msg = (f"memory budget {problem.memory_budget_bytes:.6g} bytes per device cannot be met; "
               f"the minimum-peak-memory plan needs {need:.6g} bytes")
    elif res.kind is SolveStatus.FALLBACK:
        choice = greedy(red)
        msg = f"{res.reason}; the solver stopped without a solution and a greedy plan was used"
    elif res.kind is SolveStatus.FEASIBLE:
        choice = greedy(red, round_solution(mip, res.x, red.choice), movable=red.var_groups)
        gap = "unknown" if res.gap is None else f"{100 * res.gap:.3g}%"
        msg = f"{res.reason}; used the best incumbent (gap {gap})"
        plain = greedy(red)
        if _rank(problem, plain) < _rank(problem, choice):
            choice = plain
            msg = f"{res.reason}; a greedy plan beat the best incumbent (gap {gap}) and was used"
    elif mip is None:
        choice, msg = red.choice, "presolve fixed every group; no solver needed"
    else:
        choice = round_solution(mip, res.x, red.choice)
        msg = f"optimal ({backend.value}, {n_var} variables, {n_con} constraints)"
    choice_t = tuple(int(i) for i in choice)
    if res.kind in (SolveStatus.FEASIBLE, SolveStatus.FALLBACK) and _rank(problem, choice_t)[0]:
        msg += (f"; this plan needs {peak_memory_bytes(problem, choice_t):.6g} bytes, over the "
                f"budget of {problem.memory_budget_bytes:.6g}")
    sol = IlpSolution(choice=choice_t, objective=evaluate(problem, choice_t), status=res.kind,
                      backend=None if mip is None else backend, num_variables=int(n_var),
                      num_constraints=int(n_con), solve_time_s=time.perf_counter() - t0,
                      message=msg)
    logger.info("intra-op ILP: %s in %.3f s (%d groups -> %d variables, %d constraints)",
                sol.status.value, sol.solve_time_s, len(problem.node_costs), n_var, n_con)
    return sol


def min_peak_memory(problem: IlpProblem, *, backend: SolverBackend = SolverBackend.HIGHS,
                    time_limit_s: float = 60.0) -> tuple[float, tuple[int, ...]]:
    """Minimize M subject to every memory point <= M, ignoring costs. Returns (M recomputed
    exactly, a choice attaining it); groups outside every memory point get a greedy cheap plan.

    Points are added lazily (exact): solve over the points that could reach the most, then
    add the points the choice puts above that optimum, until none is; a long program has
    thousands of points of which a few bind. Where the plan with each group at its leanest
    strategy (bytes summed over the points) leaves every point at its floor (its constant,
    once folded), that plan is the least and no MIP runs: a tensor is mostly leanest split
    finest wherever it is live (every least memory of GPT-39B K=8 M=1024 on 64 V100s)."""
    _check_args(backend, time_limit_s)
    t0 = time.perf_counter()
    ks = problem.num_strategies
    folded = problem.memory_points
    if not all(p.folded for p in folded):
        folded = tuple(folded_point(t, c) for c, t in (_fold_point(p, ks) for p in folded))
    free = _presolve(replace(problem, memory_budget_bytes=None))
    if not any(p.terms for p in folded):
        choice = greedy(free)
        return peak_memory_bytes(problem, choice), tuple(int(i) for i in choice)
    rows = point_rows(folded)     # every point as a sparse row, to price a choice at once
    hit = lean_least(rows, len(ks))
    if hit is not None:                 # every point at its floor: no MIP
        fixed, touched = free.choice.copy(), np.unique(rows.term_group)
        fixed[touched] = hit[1][touched]
        choice = greedy(free, fixed)
        return peak_memory_bytes(problem, choice), tuple(int(i) for i in choice)
    top = rows.const + np.bincount(rows.term_point, minlength=rows.const.size,
                                   weights=np.maximum.reduceat(rows.vals, rows.first))
    active = [int(i) for i in np.argsort(-top)[:LAZY_MEMORY_POINTS]]
    while True:
        sub = [(folded[i].constant_bytes, dict(folded[i].terms)) for i in active]
        remaining = max(time_limit_s - (time.perf_counter() - t0), 1e-3)
        fixed, reason = _min_peak_choice(sub, ks, free.choice, backend, remaining)
        choice = greedy(free, fixed)
        if reason:
            logger.warning("min_peak_memory: %s; using the smallest strategy per group", reason)
            break
        usage = rows.usage(choice)
        over = _fullest(usage, active, float(usage[active].max()) * (1 + 1e-9))
        if not over:
            break
        active.extend(over)
    return peak_memory_bytes(problem, choice), tuple(int(i) for i in choice)


def _min_peak_choice(points, ks, choice, backend, time_limit_s) -> tuple[np.ndarray, str]:
    """The min-max-bytes MIP over `points` (folded): the choice of their groups written into
    a copy of `choice`, and why the solver stopped without one ("" when it did not)."""
    groups = sorted({g for _, terms in points for g in terms})
    scale = max([abs(c) + sum(float(b.max()) for b in t.values()) for c, t in points] + [1.0])
    mip = Mip()
    off = mip.add_groups(groups, {g: np.zeros(ks[g]) for g in groups})
    m_col = mip.add_cols([1.0], integer=False, lower=-np.inf, upper=np.inf)
    r0 = mip.add_rows(len(points), -np.inf, -np.array([c for c, _ in points]) / scale)
    mip.add_entries(r0 + np.arange(len(points)), np.full(len(points), m_col), -1.0)
    mip.add_bytes(r0, [tuple(terms.items()) for _, terms in points], off, scale)
    mip.freeze()
    mip.rel_gap = EXACT_REL_GAP
    res = run_mip(mip, backend, time_limit_s)
    if res.x is not None:
        return round_solution(mip, res.x, choice), ""
    choice = choice.copy()
    for g in groups:
        choice[g] = int(np.argmin(sum(t[g] for _, t in points if g in t)))
    return choice, res.reason or "no solution"


def brute_force(problem: IlpProblem) -> IlpSolution:
    """Exhaustive search (for tests). Feasible choices minimize the objective; if none fits the
    budget the status is INFEASIBLE and the choice minimizes peak memory, then cost."""
    t0, ks = time.perf_counter(), problem.num_strategies
    total = math.prod(ks)
    _require(total <= _BRUTE_FORCE_LIMIT, f"brute_force would enumerate {total} combinations "
             f"(limit {_BRUTE_FORCE_LIMIT}); use solve_ilp for problems this large.")
    grid = np.indices(ks).reshape(len(ks), -1).T if ks else np.zeros((1, 0), dtype=np.int64)
    obj = np.zeros(total)
    for g, c in enumerate(problem.node_costs):
        obj += np.asarray(c, float)[grid[:, g]]
    for e in problem.edges:
        obj += np.asarray(e.cost, float)[grid[:, e.u], grid[:, e.v]]
    peak = np.zeros(total) if not problem.memory_points else np.full(total, -np.inf)
    for p in problem.memory_points:
        live = np.full(total, float(p.constant_bytes))
        for g, b in p.terms:
            live += np.asarray(b, float)[grid[:, g]]
        peak = np.maximum(peak, live)
    budget = problem.memory_budget_bytes
    ok = np.ones(total, bool) if budget is None else peak <= budget
    if ok.any():
        best, status = int(np.argmin(np.where(ok, obj, np.inf))), SolveStatus.OPTIMAL
    else:
        best, status = int(np.lexsort((obj, peak))[0]), SolveStatus.INFEASIBLE
    choice = tuple(int(i) for i in grid[best])
    return IlpSolution(choice=choice, objective=evaluate(problem, choice), status=status,
                       backend=None, solve_time_s=time.perf_counter() - t0, num_variables=0,
                       num_constraints=0, message=f"brute force over {total} combinations")
