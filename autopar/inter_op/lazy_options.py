"""Layer options priced lazily: the stage DP's (layer, submesh, view) options whose exact
plan is costly (a layer across hosts: its ILP is memory-bound, 1-60 s for GPT-39B) start as
lower bounds (`StageSolver.bound`: the ILP's LP bound without memory rows, the parameters split
as far as they go, a lower bound of the peak; a fraction of a second). Where a DP choice uses
one, its latency bound is raised to the LP with the memory rows at the budget (`tighten`: a
second LP; GPT-39B across hosts at M=128: 8-15x above the bound without the rows, the
plans 1.1-3.6x above it), and where a choice uses that one, it is solved (`refine`), one ILP
(the identical layers of one kind on one pair) per round (`exact_dp`). Every DP answer is then
the one it would give over exact options: the bounds are optimistic in latency and in memory,
so an option the DP never picks cannot be part of a better (or a feasible) layout than the
one it returns.

GPT-39B K=8 M=1024 on 64 V100s: the 45 cross-host layer ILPs (flat views of 16-64 devices,
120 s of the 174 s search) are bounded at 0.21-0.33 s per microbatch against the chosen
stages' 0.07 s, so none of them is solved (benchmarks/results/gpt39b.md).

    >>> kind = KindOptions(ctx, solve, lazy_pairs={5, 6})        # one kind of layer plan
    >>> dp = exact_dp(plain_dp, [kind], num_pairs)
    >>> choice = dp(options, budget=budget)                       # refines what it picks
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from autopar.core.enums import Remat
from autopar.core.errors import InfeasiblePlanError
from autopar.inter_op.stage_costs import (
    boundary_costs,
    layer_options,
    layer_values,
    solve_cells,
    zero_variant,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OptionContext:
    """What every kind of layer options shares: the layers, the (submesh, view) pairs, their
    cost models (`boundary_costs`), the optimizer's bytes per parameter byte, the microbatches
    (ZeRO's per-step gather), whether a pipeline (ZeRO kinds), the worker pool and which
    layers are alike (`layer_keys`; empty: every layer its own)."""
    loss: object
    boundaries: tuple[int, ...]
    submeshes: tuple
    shapes_per_k: list
    pairs: list[tuple[int, int]]
    meshes: list
    opt_ratio: float
    num_microbatches: int
    pipeline: bool
    pool: object = None
    layer_keys: tuple = ()     # per layer: equal where the layers' ILPs are one (the same slice)


class KindOptions:
    """One kind of layer plan (`solve`: the fastest or the memory-lean plan under one
    rematerialization) on every (layer, pair): its DP option arrays (`plain`, and `zero` with
    the optimizer state split, in a pipeline), each a list (latency, held, activation,
    boundary, working, deferred, pending, weight) of [L, P] arrays updated in place by `refine`. A
    pending cell holds `bound`'s lower bounds (no activations, no working or deferred bytes;
    its peak's lower bound as working bytes, see `stage_costs.layer_options`)."""

    def __init__(self, ctx: OptionContext, solve, bound=None, lazy_pairs=frozenset()):
        self.ctx, self.solve, self.bound = ctx, solve, bound
        lat, held, act, work, deferred, weight, self.sols, pending = layer_options(
            ctx.loss, ctx.boundaries, ctx.submeshes, ctx.shapes_per_k, ctx.pairs, solve,
            ctx.opt_ratio, ctx.pool, bound=bound, lazy_pairs=lazy_pairs)
        self.plain = [lat, held, act, None, work, deferred, pending, weight]
        self.loose = pending.copy()      # pending cells whose bound has no memory rows yet
        self.zero = None
        self._priced()

    def entries(self) -> list[tuple[list, bool]]:
        """(option arrays, zero) for the DP, plain first."""
        return [(self.plain, False)] + ([(self.zero, True)] if self.zero is not None else [])

    def _priced(self) -> None:
        """Boundary costs and the ZeRO twin from the current plans (in place)."""
        ctx, (lat, held, act, _, work, deferred, pending, weight) = self.ctx, self.plain
        self.plain[3] = boundary_costs(ctx.loss, ctx.boundaries, self.sols, ctx.meshes)
        zero = zero_variant(self.sols, lat, held, ctx.opt_ratio, ctx.num_microbatches)
        if ctx.pipeline and (zero is not None or pending.any()):
            zlat, zheld = zero if zero is not None else (lat.copy(), held.copy())
            if self.zero is None:
                self.zero = [zlat, zheld, act, self.plain[3], work, deferred, pending, weight]
            else:
                self.zero[0][...], self.zero[1][...] = zlat, zheld
                self.zero[3] = self.plain[3]

    def tighten(self, cells) -> None:
        """Bound the `cells` ((layer, pair), pending with the bound without memory rows) by
        their LP with memory rows (`StageSolver.bound(rows=True)`: one LP, where the exact
        solve of a memory-bound ILP takes 5-60 s; GPT-39B across hosts at M=128: a median 11x
        the bound without the rows, the plans a median 2.1x this one) and reprice."""
        ctx, lat, cells = self.ctx, self.plain[0], sorted(set(cells))
        for (l, p), (tight, _, _) in zip(cells, solve_cells(
                ctx.loss, ctx.boundaries, ctx.submeshes, ctx.shapes_per_k, ctx.pairs,
                lambda sl, sub, view: self.bound(sl, sub, view, rows=True), cells, None)):
            self.loose[l, p] = False
            was = lat[l, p]
            lat[l, p] = max(was, tight)
            log.debug("layer %d on pair %d bounded with memory rows: %.4g s (was %.4g s)",
                      l, p, lat[l, p], was)
        self._priced()

    def refine(self, cells) -> None:
        """Solve the pending `cells` ((layer, pair)) exactly and reprice."""
        ctx = self.ctx
        cells = sorted(set(cells))
        lat, held, act, _, work, deferred, pending, weight = self.plain
        for (l, p), sol in zip(cells, solve_cells(
                ctx.loss, ctx.boundaries, ctx.submeshes, ctx.shapes_per_k, ctx.pairs,
                self.solve, cells, ctx.pool)):
            self.sols[l][p] = sol
            pending[l, p] = self.loose[l, p] = False
            was = lat[l, p]
            (lat[l, p], held[l, p], act[l, p], work[l, p], deferred[l, p],
             weight[l, p]) = layer_values(sol, ctx.opt_ratio)
            log.debug("layer %d on pair %d solved: %.4g s (bounded at %.4g s)", l, p,
                      lat[l, p], was)
        self._priced()


def exact_dp(dp, kinds: list[KindOptions], num_pairs: int):
    """`dp` (the stage DP over option arrays) refined: where its choice uses pending cells,
    they are solved (`KindOptions.refine`) and the DP runs again, until its choice uses only
    exact ones. `within=T` (the re-ranking's alternatives): a choice above T that would need
    solving is not refined; the DP says infeasible instead (a choice above T that needs no
    solving is returned, as without laziness). `solved_only`: the DP over the solved cells
    alone."""
    def owner(options, p):
        arrays = options[p // num_pairs]
        for kind in kinds:
            for entry, _ in kind.entries():
                if entry is arrays:
                    return kind
        raise AssertionError("an option array no kind owns")

    def run(options, within: float | None = None, solved_only: bool = False, **kw):
        if solved_only:        # the pending cells left out, nothing refined
            return dp([[np.where(o[6], np.inf, o[0]), *o[1:]] for o in options], **kw)
        while True:
            choice = dp(options, **kw)
            if choice is None:     # nothing beats the caller's `incumbent=` / `t_max_below=`
                return None
            todo: dict[int, tuple[KindOptions, list]] = {}
            for (i, j), p in zip(choice.layer_spans, choice.submeshes):
                pending, pair = options[p // num_pairs][6], p % num_pairs
                cells = [(l, pair) for l in range(i, j + 1) if pending[l, pair]]
                if cells:
                    kind = owner(options, p)
                    todo.setdefault(id(kind), (kind, []))[1].extend(cells)
            if not todo:
                return choice
            if within is not None and choice.total_latency_s > within:
                raise InfeasiblePlanError(
                    f"no stage layout within {within:.4g} s per step without solving more "
                    "layer plans (the re-ranking's cap)", needed_bytes=0, budget_bytes=0)
            loose = [(kind, [c for c in cells if kind.loose[c]]) for kind, cells in todo.values()]
            if any(cells for _, cells in loose):      # the cheap level first, everywhere
                for kind, cells in loose:
                    kind.tighten(cells)
                continue
            # Then one ILP per round: the identical layers (one ILP, `layer_keys`) of one
            # kind on one pair that the choice uses most. Its exact values may send the DP
            # to another layout, and the layers left pending here are then never solved.
            same: dict[tuple, tuple[KindOptions, list]] = {}
            for kind, cells in todo.values():
                for l, p in cells:
                    alike = kind.ctx.layer_keys[l] if kind.ctx.layer_keys else l
                    same.setdefault((id(kind), alike, p), (kind, []))[1].append((l, p))
            kind, cells = max(same.values(), key=lambda kc: len(kc[1]))
            log.debug("stage DP: solving %d layer plans (one ILP) its choice priced by bounds",
                      len(cells))
            kind.refine(cells)
    return run


def kept_without_remat(kinds, options, span, pair) -> float | None:
    """The activations layers `span` keep per microbatch on option `pair` without
    recomputation: the sum of their fastest plans' (the DP's first kind), or None where the
    search priced no such plan (remat forced, or a layer without one)."""
    if (Remat.NONE, False, False) not in kinds:
        return None
    entry = options[kinds.index((Remat.NONE, False, False))]
    act, pending = (entry[i][span[0]:span[1] + 1, pair] for i in (2, 6))
    return float(act.sum()) if np.isfinite(act).all() and not pending.any() else None


__all__ = ["OptionContext", "KindOptions", "exact_dp", "kept_without_remat"]
