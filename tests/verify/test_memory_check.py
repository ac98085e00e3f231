"""Verified memory (`autopar.memory_check`): a plan made under a binding budget is compiled and
its `memory_analysis()` checked; over the budget it is re-planned at a scaled budget, and a
clear error names predicted and compiled bytes when nothing fits."""
import dataclasses
import types

import jax
import pytest

import autopar
from autopar.verify import memory_check
from autopar.verify.memory_check import BINDING, ROUNDS, compiled_bytes, verified_plan
from support.steps import (
    TINY_GPT,
    assert_equivalent,
    make_case,
    mesh_of,
    run_steps,
    sgd_momentum_clip,
)


def _executable(nbytes: int):
    """A stand-in executable whose memory analysis reports `nbytes` (all temp)."""
    analysis = types.SimpleNamespace(argument_size_in_bytes=0, output_size_in_bytes=0,
                                     temp_size_in_bytes=nbytes, alias_size_in_bytes=0)
    return types.SimpleNamespace(memory_analysis=lambda: analysis)


@pytest.fixture(scope="module")
def base():
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip())
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False)
    plan = par.get_plan(state, batches[0])
    # The stand-in planners' plans: the search peak is the prediction unless a test sets it.
    plan = dataclasses.replace(plan, ilp={k: v for k, v in plan.ilp.items() if k != "peak_bytes"})
    return plan, par.get_graph(state, batches[0])


def _planner(base, calls, least=100):
    """plan_at: a plan predicting 90% of the method's budget (recording the budgets asked);
    below `least` none fits."""
    plan, graph = base

    def plan_at(method):
        budget = method.memory_budget_bytes
        calls.append(budget)
        if budget < least:
            raise autopar.InfeasiblePlanError("memory: nothing fits", needed_bytes=600,
                                              budget_bytes=budget)
        return dataclasses.replace(plan, peak_memory_bytes=0.9 * budget,
                                   memory_budget_bytes=budget), graph
    return plan_at


def test_fitting_plan_is_compiled_once_and_records_the_compiled_bytes(base):
    calls, compiled = [], []

    def compile_plan(plan, graph):
        compiled.append(plan)
        return "built", _executable(950)
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                         _planner(base, calls), compile_plan)
    assert calls == [950] and len(compiled) == 1 and made.built == "built"   # at the target
    assert made.plan.measured["compiled_bytes"] == 950
    assert made.plan.measured["memory_check_rounds"] == 0
    assert "compiled by XLA to" in autopar.dump(made.plan)


def test_plan_is_made_at_the_target_first_and_at_the_budget_where_nothing_fits_below(base):
    """A user's budget is searched at (1 - HEADROOM) of it first (where a plan predicted near
    the budget would be re-planned to); where nothing fits there, at the budget itself."""
    calls = []
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                         _planner(base, calls, least=960), lambda p, g: (p, _executable(950)))
    assert calls == [950, 1000] and made.plan.memory_budget_bytes == 1000
    assert made.plan.measured == {"compiled_bytes": 950, "memory_check_rounds": 0}


def test_no_headroom_replan_below_a_target_that_fits_nothing(base):
    """Where nothing fits (1 - HEADROOM) of the budget, the plan made at the budget is not
    re-planned below the target (each such search would find nothing): two searches, then the
    compile check."""
    plan, graph = base
    calls = []

    def plan_at(method):
        budget = method.memory_budget_bytes
        calls.append(budget)
        if budget < 960:
            raise autopar.InfeasiblePlanError("memory: nothing fits", needed_bytes=960,
                                              budget_bytes=budget)
        return dataclasses.replace(plan, peak_memory_bytes=0.98 * budget,
                                   memory_budget_bytes=budget), graph
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000), plan_at,
                         lambda p, g: (p, _executable(990)))
    assert calls == [950, 1000]
    assert made.plan.measured == {"compiled_bytes": 990, "memory_check_rounds": 0}


def _over_counting(base, calls, share, looser_share=None):
    """plan_at: a plan whose search's rows count it at the whole search budget (they bind)
    while its prediction is `share` of that (temporaries XLA places in result buffers;
    `looser_share` from the second search on, where given), and the more budget the faster."""
    plan, graph = base

    def plan_at(method):
        budget = method.memory_budget_bytes
        calls.append(budget)
        got = share if looser_share is None or len(calls) == 1 else looser_share
        return dataclasses.replace(
            plan, peak_memory_bytes=got * budget, memory_budget_bytes=budget,
            predicted_compute_s=1.0 / budget, predicted_comm_s=0.0, predicted_reshard_s=0.0,
            predicted_overhead_s=0.0, ilp={**plan.ilp, "peak_bytes": float(budget)}), graph
    return plan_at


def test_rows_that_over_count_a_binding_plan_search_once_more_above_them(base):
    """Rows 20% above the prediction: one more search at the search budget raised by the
    excess; its plan (predicted within the target, faster) is taken, carrying the user's
    budget, and compiled once."""
    calls, compiled = [], []
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                         _over_counting(base, calls, 0.8),
                         lambda p, g: compiled.append(p) or (p, _executable(900)))
    assert calls == [950, int(950 + 0.2 * 950)]
    assert made.plan.peak_memory_bytes == pytest.approx(0.8 * calls[1])     # the second plan
    assert made.plan.memory_budget_bytes == 1000 and len(compiled) == 1


def test_a_looser_plan_predicted_over_the_target_is_not_taken(base):
    """The looser search's plan predicted at 0.95 x 1140 > 950: the first plan stays."""
    calls = []
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                         _over_counting(base, calls, 0.8, looser_share=0.95),
                         lambda p, g: (p, _executable(900)))
    assert calls == [950, int(950 + 0.2 * 950)]
    assert made.plan.peak_memory_bytes == pytest.approx(0.8 * 950)


def test_a_looser_search_that_finds_nothing_keeps_the_first_plan(base):
    calls, first = [], _over_counting(base, [], 0.8)

    def plan_at(method):
        calls.append(method.memory_budget_bytes)
        if len(calls) > 1:
            raise autopar.InfeasiblePlanError("memory: nothing fits", needed_bytes=2000,
                                              budget_bytes=method.memory_budget_bytes)
        return first(method)
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000), plan_at,
                         lambda p, g: (p, _executable(900)))
    assert calls == [950, int(950 + 0.2 * 950)]
    assert made.plan.peak_memory_bytes == pytest.approx(0.8 * 950)
    assert made.plan.memory_budget_bytes == 1000


def test_rows_close_to_the_prediction_are_not_loosened(base):
    """Rows within LOOSEN of the target above the prediction: no second search."""
    calls = []
    verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                  _over_counting(base, calls, 1 - memory_check.LOOSEN / 2),
                  lambda p, g: (p, _executable(900)))
    assert calls == [950]


def test_over_budget_replans_at_the_scaled_budget_until_it_fits(base):
    calls, sizes = [], iter([1250, 1100, 990])
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                         _planner(base, calls), lambda p, g: (p, _executable(next(sizes))))
    assert calls[0] == 950                                             # the target first
    # the search budget, cut to the plan's search peak (here its prediction, 90% of it),
    # scaled by budget / compiled
    assert calls[1] == pytest.approx(0.9 * 950 * 1000 / 1250, abs=1)
    assert calls[2] == pytest.approx(0.9 * calls[1] * 1000 / 1100, abs=1)
    assert made.plan.measured == {"compiled_bytes": 990, "memory_check_rounds": 2}
    assert made.plan.memory_budget_bytes == 1000       # the user's budget, not the scaled one


def test_never_fitting_raises_naming_predicted_and_compiled(base):
    calls = []
    with pytest.raises(autopar.InfeasiblePlanError) as e:
        verified_plan(autopar.ShardParallel(memory_budget_bytes=1000), _planner(base, calls),
                      lambda p, g: (p, _executable(2000)))
    assert len(calls) == ROUNDS + 1 and e.value.needed_bytes == 2000
    assert "2,000" in str(e.value) and "1,000" in str(e.value) and "predicted" in str(e.value)
    calls.clear()         # the scaled budget leaves no plan: the same error, from the re-plan
    with pytest.raises(autopar.InfeasiblePlanError) as e:
        verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                      _planner(base, calls, least=400),
                      lambda p, g: (p, _executable(3000)))
    assert calls == [950, int(0.9 * 950 * 1000 / 3000)] and "3,000" in str(e.value) \
        and "found no plan" in str(e.value)


def test_loose_budget_is_not_compiled(base):
    plan, graph = base
    loose = dataclasses.replace(plan, peak_memory_bytes=0.1, memory_budget_bytes=1.0)
    made = verified_plan(autopar.ShardParallel(), lambda m: (loose, graph),
                         lambda p, g: pytest.fail("compiled a plan far below its budget"))
    assert made.built is None and "compiled_bytes" not in made.plan.measured
    assert BINDING * 1.0 > 0.1


def test_plan_under_a_binding_budget_compiles_within_it_and_trains_like_jit(monkeypatch):
    """End to end (default XLA:CPU scheduler, in-process): a budget whose search target
    (1 - HEADROOM of it) is just above the predicted peak binds; the executable compiled for
    the check is the one the calls run (compiled once), it fits 1.1x the budget, and the step
    matches jax.jit. (A target below the free plan's peak makes the ILP memory-bound: the
    same checks, an ILP about 4x as long.)"""
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(), gpt_config=TINY_GPT)
    ref = run_steps(jax.jit(step), state, batches)
    free = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False)
    budget = int(1.05 * free.get_plan(state, batches[0]).peak_memory_bytes
                 / (1 - memory_check.HEADROOM))
    compiles = []
    real = memory_check.compiled_bytes
    monkeypatch.setattr(memory_check, "compiled_bytes",
                        lambda ex: compiles.append(ex) or real(ex))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False,
                              method=autopar.ShardParallel(memory_budget_bytes=budget))
    plan = par.get_plan(state, batches[0])
    got = compiled_bytes(par.get_compiled(state, batches[0]))
    assert plan.peak_memory_bytes <= budget and got <= 1.1 * budget
    assert plan.measured["compiled_bytes"] == got and len(compiles) >= 1
    assert compiles[-1] is par.get_compiled(state, batches[0])      # not compiled twice
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True, smooth=True)


def test_plan_predicted_near_its_budget_is_replanned_before_compiling(base):
    """A plan predicted above (1 - HEADROOM) of its budget (here: 60 bytes of copies the
    search's memory rows do not see) is re-planned at a search budget scaled by target /
    predicted, before any compile; a compile over the budget then scales the search budget
    that made the compiled plan, not the user's."""
    plan, graph = base
    calls, compiled = [], iter([1010, 960])
    target = (1 - memory_check.HEADROOM) * 1000

    def plan_at(method):
        calls.append(method.memory_budget_bytes)
        return dataclasses.replace(plan, peak_memory_bytes=method.memory_budget_bytes - 20
                                   + 60, memory_budget_bytes=method.memory_budget_bytes), graph
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000), plan_at,
                         lambda p, g: (p, _executable(next(compiled))))
    assert calls[0] == target                             # made at the target first
    assert calls[1] == int(target * target / (target + 40))   # scaled by target / predicted
    assert calls[2] == int(calls[1] * target / (calls[1] + 40))
    assert calls[2] + 40 <= target < calls[1] + 40       # then predicted within the target
    assert calls[3] == pytest.approx(calls[2] * 1000 / 1010, abs=1)   # compiled over: scaled
    assert len(calls) == 4
    assert made.plan.measured == {"compiled_bytes": 960, "memory_check_rounds": 1}


def _slack_planner(base, calls, fastest: float, copies: float):
    """plan_at: the search's plan peaks at `fastest` bytes (its memory rows' count) where the
    budget allows, else at the budget; the prediction adds `copies` the rows do not see."""
    plan, graph = base

    def plan_at(method):
        budget = method.memory_budget_bytes
        calls.append(budget)
        peak = min(budget, fastest)
        return dataclasses.replace(plan, peak_memory_bytes=peak + copies,
                                   memory_budget_bytes=budget,
                                   ilp={**plan.ilp, "peak_bytes": peak}), graph
    return plan_at


def test_replans_go_below_the_plans_own_search_peak(base):
    """A plan well inside its search budget comes back unchanged from a cut smaller than that
    slack: the re-plans cut below the plan's own search peak (`IlpStats.peak_bytes`), by what
    the prediction exceeds the target before compiling, by budget / compiled after."""
    calls = []           # search peak 940 + 60 of copies: 50 above the target (950)
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                         _slack_planner(base, calls, 940, 60),
                         lambda p, g: (p, _executable(int(p.peak_memory_bytes))))
    assert calls == [950, 890] and made.plan.peak_memory_bytes == 950
    assert made.plan.measured["memory_check_rounds"] == 0
    calls, compiled = [], iter([1100, 990])   # predicted 910 (no headroom re-plan), compiled over
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                         _slack_planner(base, calls, 900, 10),
                         lambda p, g: (p, _executable(next(compiled))))
    assert calls == [950, int(900 * 1000 / 1100)]
    assert made.plan.measured == {"compiled_bytes": 990, "memory_check_rounds": 1}
    calls = []           # copies far above the search peak: each cut at most halves it
    verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                  _slack_planner(base, calls, 100, 2000), lambda p, g: (p, _executable(900)))
    assert calls == [950, 50, 23, 10] and min(calls) > 0
