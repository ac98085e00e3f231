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
    return par.get_plan(state, batches[0]), par.get_graph(state, batches[0])


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


def test_over_budget_replans_at_the_scaled_budget_until_it_fits(base):
    calls, sizes = [], iter([1250, 1100, 990])
    made = verified_plan(autopar.ShardParallel(memory_budget_bytes=1000),
                         _planner(base, calls), lambda p, g: (p, _executable(next(sizes))))
    assert calls[0] == 950                                             # the target first
    assert calls[1] == pytest.approx(950 * 1000 / 1250, abs=1)         # budget / compiled
    assert calls[2] == pytest.approx(calls[1] * 1000 / 1100, abs=1)
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
    assert calls == [950, 316] and "3,000" in str(e.value) and "found no plan" in str(e.value)


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
