"""Layer options across hosts priced by lower bounds first (`inter_op.lazy_options`): the
bounds are below what the exact solves give, and the search chooses what it chooses with
every option solved (here exactly; in general a layout the DP prices no slower, where the
other recomputations join before unsolved plans across hosts are solved), solving fewer
ILPs."""
import types

import jax
import numpy as np
import pytest

import autopar
from autopar.core.enums import Remat
from autopar.cost.cluster import ClusterSpec
from autopar.inter_op import stages
from autopar.inter_op.lazy_options import exact_dp
from autopar.inter_op.pipeline import slice_range
from autopar.inter_op.stage_solver import StageSolver
from support.stage_mlp import bounds, loss, method  # noqa: F401  (fixtures: a four-layer MLP loss)
from support.steps import assert_equivalent, make_case, mesh_of, run_steps, sgd_momentum_clip

TWO_HOSTS = ClusterSpec.preset("v100-p3.16xlarge", num_hosts=2).with_(devices_per_host=4)


@pytest.mark.parametrize("budget", [None, 6000, 3000])
def test_bounds_are_below_the_plans_solved(loss, bounds, budget):
    """On every layer and every view of two hosts, with and without recomputation, with
    a budget that binds or not: `bound`'s latency is at most the fastest plan's (and the
    memory-lean plan's), its parameter bytes at most the plan's, its peak at most the plan's
    peak; so is the bound with memory rows. At 3000 bytes the (1, 8) view must split the
    weights of layers 1-3: the memory rows see it (40-85x the bound without them, 3-6x below
    the plan)."""
    solver = StageSolver(loss, TWO_HOSTS, method(autopar.AutoStageOption(),
                                                 memory_budget_bytes=budget), tuple(bounds))
    checked, tighter = 0, 0
    for l in range(4):
        sl = slice_range(loss, bounds[l], bounds[l + 1], l)
        for shape in ((1, 8), (8, 1), (2, 4), (4, 2)):
            for remat in (Remat.NONE, Remat.FULL):
                free, params, peak = solver.bound(sl, (2, 4), shape, remat)
                lat = solver.bound(sl, (2, 4), shape, remat, rows=True)[0]
                assert lat >= free
                tighter += lat > 10 * free
                for sol in (solver.solve(sl, (2, 4), shape, remat=remat),
                            solver.lean(sl, (2, 4), shape, remat=remat)):
                    if sol is None:
                        continue
                    checked += 1
                    assert lat <= sol.latency_s * (1 + 1e-9) + 1e-15, (l, shape, remat)
                    assert params <= sol.param_bytes * (1 + 1e-9), (l, shape, remat)
                    assert peak <= sol.peak_memory_bytes * (1 + 1e-9), (l, shape, remat)
    assert checked >= 32
    assert (tighter >= 3) if budget == 3000 else (tighter == 0)


@pytest.mark.parametrize("microbatches", [2, 64])
def test_lazy_options_choose_what_every_option_solved_chooses(loss, bounds, monkeypatch,
                                                             microbatches):
    """Two hosts of four (25 Gbps between them): the stage layout, its views, recomputation,
    ZeRO and predicted latency are those of the search that solves every layer plan up
    front."""
    m = method(autopar.AutoStageOption(), num_microbatches=microbatches)

    def search():
        return stages.choose_stages(loss, tuple(bounds), TWO_HOSTS, tuple(range(8)), m)
    lazy = search()
    monkeypatch.setattr(stages, "LAZY_ACROSS_HOSTS", False)
    eager = search()
    assert [(s.layers, s.submesh, s.solution.logical_shape, s.remat, s.zero)
            for s in lazy.stages] == [(s.layers, s.submesh, s.solution.logical_shape, s.remat,
                                       s.zero) for s in eager.stages]
    assert lazy.chosen_latency_s == pytest.approx(eager.chosen_latency_s, rel=1e-12)
    # With 64 microbatches a stage across the hosts is bounded above the chosen stages'
    # latency; with 2 the DP's alternatives pick them, and they are solved (18 vs 23 and
    # 23 vs 23 ILPs when written)
    assert lazy.num_ilps < eager.num_ilps if microbatches == 64 else \
        lazy.num_ilps <= eager.num_ilps


@pytest.mark.slow      # 25-45 s: about 100 ILPs each way under a budget that binds
def test_recomputations_join_before_unsolved_plans_across_hosts(loss, bounds, monkeypatch):
    """remat="auto" under a budget (3000 bytes) that no plan on one host fits without
    recomputation: the DP over the solved options alone is infeasible, so the other
    recomputations join before any plan across hosts is solved, and the search chooses the
    eager search's layout (two stages on 1x4, selective and none when written) with fewer
    ILPs."""
    m = method(autopar.AutoStageOption(), num_microbatches=4, remat="auto",
               memory_budget_bytes=3000)
    solved_only = []
    try_dp = stages.try_dp

    def spy(dp, options, budget, **kw):
        got = try_dp(dp, options, budget, **kw)
        if kw.get("solved_only"):
            solved_only.append(got)
        return got
    monkeypatch.setattr(stages, "try_dp", spy)

    def search():
        return stages.choose_stages(loss, tuple(bounds), TWO_HOSTS, tuple(range(8)), m)
    lazy = search()
    assert solved_only == [None]
    monkeypatch.setattr(stages, "LAZY_ACROSS_HOSTS", False)
    eager = search()
    assert [(s.layers, s.submesh, s.solution.logical_shape, s.remat) for s in lazy.stages] == \
        [(s.layers, s.submesh, s.solution.logical_shape, s.remat) for s in eager.stages]
    assert lazy.chosen_latency_s <= eager.chosen_latency_s * (1 + 1e-12)
    assert lazy.num_ilps < eager.num_ilps


def test_a_pipeline_searched_on_two_hosts_trains_like_jax_jit():
    """The whole path with lazy options: an auto-stage pipeline planned for two hosts of four
    (its cross-host layer plans bounded first) trains like `jax.jit` on one device; its stages
    cover the layers and the mesh."""
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), batch_size=16,
                                     value_and_grad=autopar.value_and_grad, num_layers=4)
    ref = run_steps(jax.jit(step), state, batches)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), cluster=TWO_HOSTS,
                              method=autopar.PipeshardParallel(
                                  num_microbatches=4,
                                  layer_option=autopar.AutoLayerOption(num_layers=4),
                                  stage_option=autopar.AutoStageOption()))
    got = run_steps(par, state, batches)
    assert_equivalent(ref, got, compare_params=True, rtol=2e-5)
    stages_ = par.get_plan(state, batches[0]).stages
    assert [s.layers[0] for s in stages_] == [0] + [s.layers[1] + 1 for s in stages_[:-1]]
    assert stages_[-1].layers[1] == 3 and sum(len(s.device_ids) for s in stages_) == 8
    assert all(s.latency_s > 0 for s in stages_)


class _FakeKind:
    """A `KindOptions` stand-in: latency arrays [layer, pair] whose pending cells move from
    a loose bound to a tight one (`tighten`) to the exact value (`refine`), calls recorded."""

    def __init__(self, exact, tight, loose_at, keys):
        self.exact, self.tight = np.array(exact), np.array(tight)
        lat = self.exact.copy()
        lat[:, 1] = loose_at
        pending = np.zeros(lat.shape, dtype=bool)
        pending[:, 1] = True
        self.arrays = [lat, None, None, None, None, None, pending]
        self.loose = pending.copy()
        self.ctx = types.SimpleNamespace(layer_keys=keys)
        self.calls = []

    def entries(self):
        return [(self.arrays, False)]

    def tighten(self, cells):
        self.calls.append(("tighten", sorted(cells)))
        for c in cells:
            self.loose[c] = False
            self.arrays[0][c] = self.tight[c]

    def refine(self, cells):
        self.calls.append(("refine", sorted(cells)))
        for c in cells:
            self.loose[c] = self.arrays[6][c] = False
            self.arrays[0][c] = self.exact[c]


def _one_stage_dp(options, **kw):
    """Every layer in one stage on the pair with the least summed latency."""
    lat = options[0][0]
    p = int(np.argmin(lat.sum(axis=0)))
    return types.SimpleNamespace(layer_spans=[(0, lat.shape[0] - 1)], submeshes=[p],
                                 total_latency_s=float(lat[:, p].sum()))


def test_the_dp_tightens_bounds_then_solves_one_ilp_per_round():
    """Pair 1's layers are bounded at 0.5 s without memory rows, 0.9 s with them, and take
    2 s when solved; pair 0's take 1 s. The DP first raises every bound it uses to the one
    with memory rows (2.7 s < 3 s: still pair 1), then solves one ILP: layers 1 and 2 are
    alike (one ILP). Pair 1 then sums to 4.9 s, so the DP returns pair 0, and layer 0 on pair
    1 is never solved."""
    kind = _FakeKind(exact=[[1.0, 2.0]] * 3, tight=[[1.0, 0.9]] * 3, loose_at=0.5,
                     keys=("first", "block", "block"))
    choice = exact_dp(_one_stage_dp, [kind], num_pairs=2)([kind.arrays])
    assert choice.submeshes == [0] and choice.total_latency_s == pytest.approx(3.0)
    assert kind.calls == [("tighten", [(0, 1), (1, 1), (2, 1)]),
                          ("refine", [(1, 1), (2, 1)])]
