"""Alpa's stage / submesh DP (autopar.inter_op.stage_dp): pure numpy, no devices needed."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.core.errors import InfeasiblePlanError, InvalidArgumentError
from autopar.inter_op import (
    StageCosts,
    SubmeshShape,
    brute_force_stages,
    candidate_submeshes,
    solve_stage_dp,
)


def _shapes(submeshes):
    return [(s.num_hosts, s.devices_per_host) for s in submeshes]


def _costs(latency, static=None, act=None, budget=np.inf):
    latency = np.asarray(latency, dtype=float)
    zeros = np.zeros_like(latency)
    return StageCosts(latency_s=latency,
                      static_bytes=zeros if static is None else static,
                      activation_bytes=zeros if act is None else act,
                      memory_budget_bytes=budget)


def _span_costs(num_layers, submeshes, fn):
    """[L, L, K] array with fn(num_layers_in_span, submesh) on i <= j, inf below."""
    out = np.full((num_layers, num_layers, len(submeshes)), np.inf)
    for i in range(num_layers):
        for j in range(i, num_layers):
            for k, s in enumerate(submeshes):
                out[i, j, k] = fn(j - i + 1, s)
    return out


def _check_valid(result, costs, submeshes, num_devices, num_microbatches, max_stages=None):
    spans = result.layer_spans
    assert spans[0][0] == 0 and spans[-1][1] == costs.num_layers - 1
    assert all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:]))
    assert all(i <= j for i, j in spans)
    assert sum(submeshes[k].num_devices for k in result.submeshes) == num_devices
    num_stages = len(spans)
    assert max_stages is None or num_stages <= max_stages
    times = []
    for p, ((i, j), k) in enumerate(zip(spans, result.submeshes)):
        mem = costs.static_bytes[i, j, k] + (num_stages - p) * costs.activation_bytes[i, j, k]
        assert mem <= costs.memory_budget_bytes
        assert np.isfinite(costs.latency_s[i, j, k])
        times.append(costs.latency_s[i, j, k])
    assert result.stage_latency_s == pytest.approx(times)
    expected = sum(times) + (num_microbatches - 1) * max(times)
    assert result.total_latency_s == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_candidate_submeshes():
    assert _shapes(candidate_submeshes(1, 8)) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert _shapes(candidate_submeshes(2, 8)) == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]
    assert _shapes(candidate_submeshes(3, 4))[-2:] == [(2, 4), (3, 4)]
    assert SubmeshShape(num_hosts=2, devices_per_host=4).num_devices == 8
    with pytest.raises(InvalidArgumentError, match="num_hosts"):
        candidate_submeshes(0, 8)


def _random_instance(rng):
    num_layers = int(rng.integers(1, 6))
    num_hosts = int(rng.choice([1, 2]))
    submeshes = candidate_submeshes(num_hosts, 8 // num_hosts)
    flops = rng.uniform(0.5, 2.0, size=num_layers)
    params = rng.uniform(1.0, 4.0, size=num_layers)
    acts = rng.uniform(0.5, 3.0, size=num_layers)
    shape = (num_layers, num_layers, len(submeshes))
    latency, static, act = np.full(shape, np.inf), np.zeros(shape), np.zeros(shape)
    for i in range(num_layers):
        for j in range(i, num_layers):
            for k, s in enumerate(submeshes):
                n = s.num_devices
                eff = rng.uniform(0.6, 1.0) / n ** 0.3       # big submeshes scale worse
                latency[i, j, k] = flops[i:j + 1].sum() / (n * eff) + 0.05 * (n > 1) * rng.random()
                # Sub-linear sharding: more, smaller stages need less memory per device.
                static[i, j, k] = params[i:j + 1].sum() / n ** 0.6 * rng.uniform(0.8, 1.2)
                act[i, j, k] = acts[i:j + 1].sum() / n ** 0.8 * rng.uniform(0.8, 1.2)
    latency[rng.random(shape) < 0.15] = np.inf
    # Budgets around what one stage on all 8 devices needs: sometimes nothing fits, sometimes
    # memory forces more stages, sometimes it does not bind.
    whole = static[0, -1, -1] + act[0, -1, -1]
    budget = float(rng.choice([np.inf, *(whole * rng.uniform(0.8, 1.5, size=3))]))
    return _costs(latency, static, act, budget), submeshes, int(rng.choice([1, 2, 4, 16]))


@pytest.mark.parametrize("seed", range(60))
def test_dp_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    costs, submeshes, num_microbatches = _random_instance(rng)
    max_stages = None if seed % 3 else int(rng.integers(1, 5))
    args = (costs, submeshes, 8, num_microbatches)
    try:
        expected = brute_force_stages(*args, max_stages=max_stages)
    except (InfeasiblePlanError, InvalidArgumentError) as err:
        with pytest.raises(type(err)) as got:
            solve_stage_dp(*args, max_stages=max_stages)
        if isinstance(err, InfeasiblePlanError):
            assert got.value.needed_bytes == err.needed_bytes
            assert got.value.budget_bytes == err.budget_bytes
        return
    result = solve_stage_dp(*args, max_stages=max_stages)
    assert result.total_latency_s == pytest.approx(expected.total_latency_s, rel=1e-9, abs=1e-9)
    _check_valid(result, costs, submeshes, 8, num_microbatches, max_stages)
    _check_valid(expected, costs, submeshes, 8, num_microbatches, max_stages)


def test_random_instances_cover_binding_memory():
    """The seeded instances above include plans where memory binds (the unconstrained optimum
    does not fit) and where it forces more stages than the unconstrained optimum uses."""
    binding = more_stages = infeasible = 0
    for seed in range(60):
        costs, submeshes, b = _random_instance(np.random.default_rng(seed))
        free = _costs(costs.latency_s, costs.static_bytes, costs.activation_bytes)
        try:
            unconstrained = solve_stage_dp(free, submeshes, 8, b)
            constrained = solve_stage_dp(costs, submeshes, 8, b)
        except InfeasiblePlanError:
            infeasible += 1
            continue
        except InvalidArgumentError:
            continue
        binding += constrained.total_latency_s > unconstrained.total_latency_s + 1e-12
        more_stages += constrained.num_stages > unconstrained.num_stages
    assert binding >= 3 and more_stages >= 2 and infeasible >= 2


def test_memory_forces_more_stages():
    submeshes = candidate_submeshes(1, 2)                     # (1, 1), (1, 2)
    latency = _span_costs(4, submeshes, lambda n, s: n / s.num_devices * 0.6)
    static = _span_costs(4, submeshes, lambda n, s: 10.0 * n / s.num_devices)
    args = (submeshes, 2, 1)
    free = solve_stage_dp(_costs(latency, static), *args)
    assert free.layer_spans == ((0, 3),) and free.submeshes == (1,)
    tight = _costs(latency, static, budget=25.0)              # one stage needs 20 on 2 devices...
    assert solve_stage_dp(tight, *args).num_stages == 1
    tighter = _costs(latency, static, budget=19.0)            # ...two stages need 20 each: no
    with pytest.raises(InfeasiblePlanError):
        solve_stage_dp(tighter, *args)
    static[0, 3, 1] = 100.0                                   # the single stage no longer fits
    result = solve_stage_dp(_costs(latency, static, budget=25.0), *args)
    assert result.num_stages == 2 and result.layer_spans == ((0, 1), (2, 3))
    assert result.total_latency_s == pytest.approx(
        brute_force_stages(_costs(latency, static, budget=25.0), *args).total_latency_s)


def _balanced(num_layers=4):
    submeshes = candidate_submeshes(1, 4)                     # 1, 2, 4 devices
    latency = _span_costs(num_layers, submeshes,
                          lambda n, s: n / s.num_devices + 0.5 * (s.num_devices > 1))
    return _costs(latency), submeshes


def test_pipelining_wins_with_many_microbatches():
    costs, submeshes = _balanced()
    result = solve_stage_dp(costs, submeshes, 4, 16)
    assert result.layer_spans == ((0, 0), (1, 1), (2, 2), (3, 3))
    assert result.submeshes == (0, 0, 0, 0)
    assert result.total_latency_s == pytest.approx(4 + 15 * 1.0)
    assert result.total_latency_s == pytest.approx(
        brute_force_stages(costs, submeshes, 4, 16).total_latency_s)


def test_single_stage_wins_with_one_microbatch():
    costs, submeshes = _balanced()
    result = solve_stage_dp(costs, submeshes, 4, 1)
    assert result.layer_spans == ((0, 3),) and result.submeshes == (2,)
    assert result.total_latency_s == pytest.approx(1.5)
    capped = solve_stage_dp(costs, submeshes, 4, 16, max_stages=1)
    assert capped.num_stages == 1 and capped.total_latency_s == pytest.approx(16 * 1.5)


def test_in_flight_memory_rule():
    """Under 1F1B the first of S stages keeps S microbatches' activations, the last keeps one."""
    submeshes = candidate_submeshes(1, 1)                     # only (1, 1): two 1-device stages
    latency = _span_costs(2, submeshes, lambda n, s: float(n))
    act = np.zeros_like(latency)
    act[0, 0, 0], act[1, 1, 0] = 5.0, 12.0                    # first: 2 x 5 = 10, last: 12
    result = solve_stage_dp(_costs(latency, act=act, budget=15.0), submeshes, 2, 4)
    assert result.layer_spans == ((0, 0), (1, 1))
    act[0, 0, 0], act[1, 1, 0] = 12.0, 5.0                    # first: 2 x 12 = 24 > 15
    with pytest.raises(InfeasiblePlanError) as err:
        solve_stage_dp(_costs(latency, act=act, budget=15.0), submeshes, 2, 4)
    assert err.value.needed_bytes == 24 and err.value.budget_bytes == 15
    with pytest.raises(InfeasiblePlanError) as ref:
        brute_force_stages(_costs(latency, act=act, budget=15.0), submeshes, 2, 4)
    assert ref.value.needed_bytes == 24


def test_infeasible_reports_smallest_need():
    costs, submeshes = _balanced(3)
    static = _span_costs(3, submeshes, lambda n, s: 100.0 * n / s.num_devices)
    tight = _costs(costs.latency_s, static, budget=50.0)
    with pytest.raises(InfeasiblePlanError, match="memory_budget_bytes") as err:
        solve_stage_dp(tight, submeshes, 4, 8)
    # Best: one stage, 3 layers on 4 devices -> 75 per device (every split needs >= 100).
    assert err.value.needed_bytes == 75 and err.value.budget_bytes == 50
    with pytest.raises(InfeasiblePlanError) as ref:
        brute_force_stages(tight, submeshes, 4, 8)
    assert ref.value.needed_bytes == 75


def test_no_covering_raises_invalid_argument():
    costs, submeshes = _balanced(2)
    with pytest.raises(InvalidArgumentError, match="num_devices=3"):
        solve_stage_dp(costs, submeshes, 3, 4, max_stages=1)  # 3 is no single submesh size


@pytest.mark.parametrize("bad", [
    dict(latency_s=np.zeros((2, 3, 1))),
    dict(latency_s=np.zeros((2, 2))),
    dict(static_bytes=np.zeros((3, 3, 1))),
    dict(activation_bytes=np.full((2, 2, 1), np.nan)),
    dict(latency_s=-np.ones((2, 2, 1))),
    dict(static_bytes=np.full((2, 2, 1), np.inf)),
    dict(memory_budget_bytes=0),
])
def test_bad_costs_raise(bad):
    fields = dict(latency_s=np.ones((2, 2, 1)), static_bytes=np.zeros((2, 2, 1)),
                  activation_bytes=np.zeros((2, 2, 1)), memory_budget_bytes=1.0)
    with pytest.raises(InvalidArgumentError):
        StageCosts(**{**fields, **bad})


def test_bad_arguments_raise():
    costs, submeshes = _balanced(2)
    with pytest.raises(InvalidArgumentError, match="K=3"):
        solve_stage_dp(costs, submeshes[:2], 4, 4)
    for kwargs in (dict(num_microbatches=0), dict(num_devices=0),
                   dict(num_microbatches=2, max_stages=0), dict(num_microbatches=True)):
        args = dict(num_devices=4, num_microbatches=4) | kwargs
        with pytest.raises(InvalidArgumentError):
            solve_stage_dp(costs, submeshes, **args)
    with pytest.raises(InvalidArgumentError):
        solve_stage_dp(costs, [], 4, 4)
    with pytest.raises(InvalidArgumentError, match="brute_force_stages would enumerate"):
        big = _costs(np.ones((12, 12, 5)))
        brute_force_stages(big, candidate_submeshes(2, 8), 16, 4)


def test_pruning_skips_large_t_max():
    rng = np.random.default_rng(7)
    submeshes = candidate_submeshes(1, 8)
    latency = _span_costs(5, submeshes, lambda n, s: n / s.num_devices * rng.uniform(1, 2))
    costs = _costs(latency)
    result = solve_stage_dp(costs, submeshes, 8, 8)
    distinct = len(np.unique(latency[np.isfinite(latency)]))
    assert result.num_pruned > 0
    assert result.num_candidates + result.num_pruned == distinct
    assert result.total_latency_s == pytest.approx(
        brute_force_stages(costs, submeshes, 8, 8).total_latency_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_dominated_options_change_nothing(seed):
    """Options of the same device count as another but slower and not leaner (the DP's
    options per (submesh, view, remat, ZeRO) kind) never change the assignment: the DP runs
    over device counts and re-derives the choice over every option."""
    rng = np.random.default_rng(seed)
    costs, submeshes, b = _random_instance(rng)
    copies = 3
    perm = rng.permutation(len(submeshes) * (copies + 1))   # originals among the copies
    lat, static, act = ([a] for a in (costs.latency_s, costs.static_bytes,
                                      costs.activation_bytes))
    for _ in range(copies):
        lat.append(costs.latency_s * rng.uniform(1.0, 2.0, costs.latency_s.shape))
        static.append(costs.static_bytes + rng.uniform(0.0, 1.0, costs.static_bytes.shape))
        act.append(costs.activation_bytes * rng.uniform(1.0, 1.5, costs.latency_s.shape))
    many = _costs(*(np.concatenate(a, axis=2)[..., perm] for a in (lat, static, act)),
                  budget=costs.memory_budget_bytes)
    subs = [submeshes[i % len(submeshes)] for i in perm]
    try:
        expected = solve_stage_dp(costs, submeshes, 8, b)
    except (InfeasiblePlanError, InvalidArgumentError) as err:
        with pytest.raises(type(err)):
            solve_stage_dp(many, subs, 8, b)
        return
    got = solve_stage_dp(many, subs, 8, b)
    assert got.layer_spans == expected.layer_spans
    assert got.total_latency_s == expected.total_latency_s
    # each stage on an option of the same submesh and latency as the original's choice
    assert [subs[k] for k in got.submeshes] == [submeshes[k] for k in expected.submeshes]
    assert got.stage_latency_s == expected.stage_latency_s
    _check_valid(got, many, subs, 8, b)


def test_dp_bisects_the_caps_that_admit_no_plan(monkeypatch):
    """With many microbatches the best plan's slowest stage is near the least possible one:
    the caps below the first that admits a plan are found by bisection (a few DPs), not one
    DP each; the result is the brute force's."""
    from autopar.inter_op import stage_dp
    rng = np.random.default_rng(3)
    submeshes = candidate_submeshes(1, 8) * 6          # 24 options, 4 device counts
    latency = _span_costs(6, submeshes, lambda n, s: n / s.num_devices * rng.uniform(1, 3))
    costs = _costs(latency)
    calls = []
    real = stage_dp._run_dp
    monkeypatch.setattr(stage_dp, "_run_dp", lambda *a, **k: calls.append(1) or real(*a, **k))
    result = solve_stage_dp(costs, submeshes, 8, 1000)
    monkeypatch.undo()
    # t_max candidates: the least latency per span and device count (21 spans x 4), not
    # every option's (504 distinct values)
    assert len(np.unique(latency[np.isfinite(latency)])) > 400
    assert result.num_candidates + result.num_pruned <= 21 * 4
    assert result.num_candidates > 30
    assert len(calls) <= 1 + 7 + 5          # uncapped, bisection of 84 caps, a few scanned
    least = _costs(latency.reshape(6, 6, 6, 4).min(axis=2))   # the fastest copy per submesh
    assert result.total_latency_s == pytest.approx(
        brute_force_stages(least, submeshes[:4], 8, 1000).total_latency_s, rel=1e-12)


def _table_states(schedule, num_microbatches):
    from autopar.inter_op.schedule import make_schedule
    return lambda s: make_schedule(schedule, s, num_microbatches).kept_states()


@pytest.mark.parametrize("seed", range(50))
def test_dp_with_a_schedule_matches_brute_force(seed):
    """Per-schedule memory (the (in flight, deferred) states of each stage count's table,
    with W's bytes) and objective (b of 1F1B's bubble): the DP equals the exhaustive search."""
    from autopar.core.enums import Schedule
    rng = np.random.default_rng(1000 + seed)
    costs, submeshes, m = _random_instance(rng)
    weight = costs.activation_bytes * rng.uniform(0.2, 0.8)
    costs = StageCosts(latency_s=costs.latency_s, static_bytes=costs.static_bytes,
                       activation_bytes=costs.activation_bytes, weight_bytes=weight,
                       memory_budget_bytes=costs.memory_budget_bytes)
    schedule = [Schedule.ZERO_BUBBLE_H1, Schedule.ZERO_BUBBLE_H2, Schedule.GPIPE,
                Schedule.ONE_F_ONE_B, None][seed % 5]
    # None: one microbatch at every stage, fewer than 1F1B keeps (its bound is not 1F1B's)
    kw = dict(max_stages=None if seed % 3 else int(rng.integers(1, 5)),
              kept=_table_states(schedule, m) if schedule else lambda s: [((1, 1),)] * s,
              bubble=[0.0, 0.3, 1.0, lambda s: 1.0 / s][seed % 5 % 4])
    args = (costs, submeshes, 8, m)
    try:
        expected = brute_force_stages(*args, **kw)
    except (InfeasiblePlanError, InvalidArgumentError) as err:
        with pytest.raises(type(err)) as got:
            solve_stage_dp(*args, **kw)
        if isinstance(err, InfeasiblePlanError):
            assert got.value.needed_bytes == err.needed_bytes
        return
    result = solve_stage_dp(*args, **kw)
    assert result.total_latency_s == pytest.approx(expected.total_latency_s, rel=1e-9, abs=1e-9)
    times = [costs.latency_s[i, j, k] for (i, j), k in zip(result.layer_spans, result.submeshes)]
    b = kw["bubble"](len(times)) if callable(kw["bubble"]) else kw["bubble"]
    assert result.total_latency_s == pytest.approx(m * max(times) + b * (sum(times) - max(times)))


def test_the_default_states_are_1f1b_s():
    """`kept` = 1F1B's table gives what the single DP over every stage count gives."""
    from autopar.core.enums import Schedule
    for seed in range(20):
        costs, submeshes, m = _random_instance(np.random.default_rng(seed))
        try:
            plain = solve_stage_dp(costs, submeshes, 8, m)
        except (InfeasiblePlanError, InvalidArgumentError):
            continue
        tabled = solve_stage_dp(costs, submeshes, 8, m,
                                kept=_table_states(Schedule.ONE_F_ONE_B, m))
        assert tabled.total_latency_s == pytest.approx(plain.total_latency_s)


def test_deferred_weight_gradients_and_a_smaller_bubble_change_the_layout():
    """Two layers on 2 devices. Under 1F1B one stage on both devices wins; a schedule that
    defers W (ZB-H1: stage p keeps p + 1 deferred) and a budget that cannot hold them forces
    it back; a schedule with no bubble (b = 0) prefers the two-stage pipeline whose slowest
    stage is shorter, where 1F1B's bubble makes it slower."""
    from autopar.core.enums import Schedule
    submeshes = candidate_submeshes(1, 2)                          # (1, 1), (1, 2)
    latency = _span_costs(2, submeshes, lambda n, s: n / s.num_devices * (1.3 if
                                                                            s.num_devices == 2
                                                                            else 1.0))
    act = _span_costs(2, submeshes, lambda n, s: 1.0 * n / s.num_devices)
    costs = _costs(latency, act=act)
    one_f = solve_stage_dp(costs, submeshes, 2, 2)
    assert one_f.num_stages == 1                  # 1.3 x 2 microbatches < 1 + 1 x 2
    no_bubble = solve_stage_dp(costs, submeshes, 2, 2, bubble=0.0)
    assert no_bubble.num_stages == 2 and no_bubble.total_latency_s == pytest.approx(2.0)
    # ZB-H1 with 2 stages: the last passes through 2 deferred W's (2 x 2 bytes > 3.5); one
    # stage on both devices keeps at most 1 microbatch (1 x 2 bytes).
    weighted = StageCosts(latency_s=latency, static_bytes=np.zeros_like(latency),
                          activation_bytes=act, weight_bytes=act * 2.0, memory_budget_bytes=3.5)
    h1 = solve_stage_dp(weighted, submeshes, 2, 2, bubble=0.0,
                        kept=_table_states(Schedule.ZERO_BUBBLE_H1, 2))
    assert h1.num_stages == 1
    plain = StageCosts(latency_s=latency, static_bytes=np.zeros_like(latency),
                       activation_bytes=act, memory_budget_bytes=3.5)
    assert solve_stage_dp(plain, submeshes, 2, 2, bubble=0.0,
                          kept=_table_states(Schedule.ZERO_BUBBLE_H1, 2)).num_stages == 2


def test_bad_schedule_arguments_are_named():
    costs, submeshes, m = _random_instance(np.random.default_rng(3))
    with pytest.raises(InvalidArgumentError, match="bubble=1.5"):
        solve_stage_dp(costs, submeshes, 8, m, bubble=1.5)
    with pytest.raises(InvalidArgumentError, match=r"kept\(1\) gave 0"):
        solve_stage_dp(costs, submeshes, 8, m, kept=lambda s: [])


@pytest.mark.parametrize("seed", range(30))
def test_an_incumbent_prunes_and_changes_no_answer(seed):
    """`incumbent`: above the best T the same layout comes back; at or below it, None (no
    error, whatever memory says); it searches no more t_max caps than without."""
    from autopar.core.enums import Schedule
    rng = np.random.default_rng(2000 + seed)
    costs, submeshes, m = _random_instance(rng)
    kw = dict(kept=_table_states(Schedule.ZERO_BUBBLE_H1, m), bubble=lambda s: 0.5) \
        if seed % 2 else {}
    args = (costs, submeshes, 8, m)
    try:
        plain = solve_stage_dp(*args, **kw)
    except (InfeasiblePlanError, InvalidArgumentError):
        assert solve_stage_dp(*args, incumbent=1e30, **kw) is None
        return
    t = plain.total_latency_s
    above = solve_stage_dp(*args, incumbent=t * (1 + 1e-6) + 1e-12, **kw)
    assert above.total_latency_s == t and above.layer_spans == plain.layer_spans
    assert above.num_candidates <= plain.num_candidates
    assert solve_stage_dp(*args, incumbent=t, **kw) is None


def test_counts_1f1b_memory_rules_out_build_no_table(monkeypatch):
    """A schedule keeping at least 1F1B's microbatches in flight (ZB-H1) skips the stage
    counts where nothing fits even 1F1B's memory before building their memory tables; the
    answer is the brute force's."""
    from autopar.core.enums import Schedule
    from autopar.inter_op import dp_memory
    submeshes = candidate_submeshes(1, 8)
    latency = _span_costs(6, submeshes, lambda n, s: n / s.num_devices ** 0.9)
    act = _span_costs(6, submeshes, lambda n, s: 1.0)      # per microbatch, whatever the span
    costs = StageCosts(latency_s=latency, static_bytes=np.zeros_like(latency),
                       activation_bytes=act, weight_bytes=act * 0.1, memory_budget_bytes=3.5)
    built = []
    real = dp_memory._count_memory
    monkeypatch.setattr(dp_memory, "_count_memory",
                        lambda memory, kept, s: built.append(s) or real(memory, kept, s))
    kw = dict(kept=_table_states(Schedule.ZERO_BUBBLE_H1, 16), bubble=lambda s: 0.5)
    got = solve_stage_dp(costs, submeshes, 8, 16, **kw)
    # 1F1B's first stage of S keeps S microbatches (S bytes): more than 3 stages never fit
    assert built and max(built) <= 3
    assert got.total_latency_s == pytest.approx(
        brute_force_stages(costs, submeshes, 8, 16, **kw).total_latency_s)


@pytest.mark.parametrize("seed", range(30))
def test_t_max_below_finds_the_best_faster_slowest_stage(seed):
    """`t_max_below`: the best assignment whose every stage is faster than the cap, i.e. the
    exhaustive search with the slower spans removed; None where there is none."""
    from autopar.core.enums import Schedule
    rng = np.random.default_rng(3000 + seed)
    costs, submeshes, m = _random_instance(rng)
    finite = costs.latency_s[np.isfinite(costs.latency_s)]
    if not finite.size:
        return
    kw = dict(kept=_table_states(Schedule.ZERO_BUBBLE_H2, m), bubble=lambda s: 0.2) \
        if seed % 2 else {}
    try:        # the cap at the uncapped answer's slowest stage: it must find another
        cap = max(solve_stage_dp(costs, submeshes, 8, m, **kw).stage_latency_s)
    except (InfeasiblePlanError, InvalidArgumentError):
        cap = float(np.quantile(finite, rng.uniform(0.1, 0.9)))
    masked = StageCosts(latency_s=np.where(costs.latency_s < cap, costs.latency_s, np.inf),
                        static_bytes=costs.static_bytes,
                        activation_bytes=costs.activation_bytes,
                        memory_budget_bytes=costs.memory_budget_bytes)
    got = solve_stage_dp(costs, submeshes, 8, m, t_max_below=cap, **kw)
    try:
        expected = brute_force_stages(masked, submeshes, 8, m, **kw)
    except (InfeasiblePlanError, InvalidArgumentError):
        assert got is None
        return
    assert max(got.stage_latency_s) < cap
    assert got.total_latency_s == pytest.approx(expected.total_latency_s, rel=1e-9, abs=1e-9)
