"""Verified memory for pipelines (`autopar.pipeline_memory_check`, `runtime.compile_only`): a
pipeline plan whose stage predictions bind the budget is compiled stage by stage during
planning; each stage's peak, composed from `memory_analysis()` of its executables, is recorded
and checked; over the budget the plan is re-made at a scaled budget or refused naming the
stage and its bytes. The executables compiled for the check are the ones the first call runs."""
import dataclasses
import json
import logging
import re
import warnings

import jax
import pytest

import autopar
from autopar.runtime.compile_only import Role, abstract_args, compile_program, shard_bytes
from autopar.verify import pipeline_memory_check as pmc
from autopar.verify.memory_check import ROUNDS
from support.steps import (
    TINY_GPT,
    assert_equivalent,
    make_case,
    mesh_of,
    run_steps,
    sgd_momentum_clip,
)


def _pipe(budget=None, microbatches=4):
    return autopar.PipeshardParallel(
        num_microbatches=microbatches, layer_option=autopar.AutoLayerOption(num_layers=2),
        stage_option=autopar.UniformStageOption(num_stages=2), memory_budget_bytes=budget)


@pytest.fixture(scope="module")
def gpt():
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(), gpt_config=TINY_GPT,
                                     value_and_grad=autopar.value_and_grad)
    free = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(), plan_cache=False)
    plan = free.get_plan(state, batches[0])
    return step, state, batches, plan, run_steps(jax.jit(step), state, batches)


def _terms(c):
    m = c.compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def test_binding_budget_records_compiled_stage_bytes_and_trains_like_jit(gpt, caplog):
    """A budget the prediction binds (and the compiled peaks fit): the plan records each
    stage's compiled peak, equal to its composition from a direct memory_analysis() of the
    stage's executables; the dump shows them with the ratio; the first call compiles no stage
    executable again; the step equals jax.jit's."""
    step, state, batches, free, ref = gpt
    assert "compiled_stage_bytes" not in free.measured        # a loose budget: not compiled
    budget = int(1.4 * max(s.peak_memory_bytes for s in free.stages))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(budget),
                              plan_cache=False)
    plan = par.get_plan(state, batches[0])
    got = plan.measured["compiled_stage_bytes"]
    assert len(got) == 2 and max(got) <= budget and plan.measured["memory_check_rounds"] == 0
    assert plan.memory_budget_bytes == budget
    # Direct: compile the program again and compose each stage from memory_analysis().
    program = par._entry_of((state, batches[0]))[0].executor.p
    calls, stats = compile_program(program, abstract_args(jax.tree.leaves((state, batches[0])),
                                                         program.in_shardings))
    terms = plan.measured["compiled_stage_memory"]
    flat = abstract_args(jax.tree.leaves((state, batches[0])), program.in_shardings)
    for s, t in enumerate(terms):
        assert t["held"] == sum(shard_bytes(a) for a, where in zip(
            flat, program.placement.input_stage) if where == s)       # state + batch on s
        mine = {c.role: c for c in calls if c.stage == s}
        fwd = mine.get(Role.FORWARD)
        stash = shard_bytes(fwd.outs[2]) + shard_bytes(
            [[*fwd.args[2], *fwd.args[3]][i] for i in program.stages[s].saved_acts]) \
            if fwd else 0
        assert t["stash"] == stash
        assert t["in_flight"] == max(q for q, _ in stats.kept_states[s])
        assert t["deferred"] == 0 and {d for _, d in stats.kept_states[s]} == {0}   # 1F1B
        assert got[s] == max(t["held"] + t["data"] + t["accumulator"] + t["in_flight"]
                             * t["stash"] + t["work"], t["held"] + t["apply"])
        # The largest pipeline executable fits inside the composed peak.
        assert max(_terms(c) for c in calls if c.stage == s and c.role != Role.APPLY) <= got[s]
    assert stats.max_live_microbatches == [2, 0]   # 1F1B: stage 0 keeps 2, the last fuses
    # What the stage stashes per microbatch is what the stage search predicted: the forward
    # returns no copies of the stage's parameters (lower_pipeline keeps them by reference).
    assert terms[0]["stash"] == pytest.approx(plan.stages[0].activation_bytes, rel=0.05)
    for s, c in zip(plan.stages, got):
        assert 0.5 < s.peak_memory_bytes / c < 1.5
    text = autopar.dump(plan)
    assert "predicted / compiled" in text and "compiled" in text.split("stage  ")[1]
    again = autopar.ParallelPlan.from_json(plan.to_json())
    assert again.measured["compiled_stage_bytes"] == got
    caplog.clear()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        par(state, batches[0])                 # the first call
    compiled_now = set(re.findall(r"Compiling jit\(([^)]*)\)", caplog.text))
    assert "<lambda>" in compiled_now          # the executor's helpers (batch split) compile
    assert not compiled_now & {"forward", "backward", "fused", "run"}   # the stages do not
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True, smooth=True)


# Slow: compiles the pipeline 2-4 times; the re-plan loop is tested on stand-ins below.
@pytest.mark.slow
def test_budget_below_the_compiled_peak_replans_naming_bytes(gpt, caplog):
    """A budget the prediction fits but the compiled peak does not (the tiny GPT's stage 0
    compiles to ~3% over its prediction): re-planned at a scaled budget, logged with the stage
    and its bytes; the re-made plan's compiled peaks fit, or, where none does within the
    rounds, the error names the stage, the predicted and compiled bytes and the budget (the
    refusal after the last round: test_never_fitting_raises_after_the_rounds)."""
    step, state, batches, free, ref = gpt
    budget = int(1.02 * max(s.peak_memory_bytes for s in free.stages))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(budget),
                              plan_cache=False)
    with caplog.at_level(logging.WARNING, logger="autopar.verify.memory_check"):
        try:
            plan = par.get_plan(state, batches[0])
        except autopar.InfeasiblePlanError as e:
            text = str(e)
            assert "XLA compiled it to" in text and "predicted" in text
            assert f"{budget:,}" in text and "re-plan" in text
            assert e.needed_bytes > budget and e.budget_bytes == budget
        else:
            assert plan.measured["memory_check_rounds"] >= 1
            assert max(plan.measured["compiled_stage_bytes"]) <= budget
            assert_equivalent(ref, run_steps(par, state, batches), compare_params=True,
                              smooth=True)
    replans = [r.getMessage() for r in caplog.records if "re-planning" in r.getMessage()]
    assert replans and "XLA compiled it to" in replans[0] and f"{budget:,}" in replans[0]


# --- the re-plan loop on stand-in plans (no compiling) --------------------------------------

def _memory(peak):
    return (pmc.StageMemory(stage=0, held=peak, data=0, accumulator=0, stash=0, in_flight=0,
                            work=0, apply=0),)


def test_replans_at_scaled_budgets_until_a_stage_fits(gpt, monkeypatch):
    *_, free, _ = gpt
    plan = dataclasses.replace(free, memory_budget_bytes=1000.0, stages=free.stages[:1])
    plan = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0],
                                                                 peak_memory_bytes=900.0),))
    asked, peaks = [], iter([1250, 1100, 990])
    monkeypatch.setattr(pmc, "stage_memory", lambda program, leaves, m: _memory(next(peaks)))

    def plan_at(budget):
        asked.append(budget)
        return plan, "parts", "graph"
    made = pmc.verified_pipeline(plan_at, lambda parts: "program", [])
    # the predicted 900 scaled by budget / compiled, then the last budget scaled again
    assert asked[0] is None and asked[1] == pytest.approx(900 * 1000 / 1250, abs=1)
    assert asked[2] == pytest.approx(720 * 1000 / 1100, abs=1)
    assert made.plan.measured["compiled_stage_bytes"] == [990]
    assert made.plan.measured["memory_check_rounds"] == 2 and made.program == "program"
    assert made.plan.memory_budget_bytes == 1000       # the user's budget, not the scaled one
    json.loads(made.plan.to_json())


def test_never_fitting_raises_after_the_rounds(gpt, monkeypatch):
    *_, free, _ = gpt
    plan = dataclasses.replace(free, memory_budget_bytes=1000.0)
    monkeypatch.setattr(pmc, "stage_memory", lambda program, leaves, m: _memory(2000))
    asked = []
    with pytest.raises(autopar.InfeasiblePlanError, match="stage 0") as e:
        pmc.verified_pipeline(lambda b: asked.append(b) or (plan, None, None),
                              lambda parts: None, [])
    assert len(asked) == ROUNDS + 1 and "2,000" in str(e.value) and e.value.needed_bytes == 2000
    # A loose budget is never compiled.
    loose = dataclasses.replace(free, memory_budget_bytes=1e12)
    made = pmc.verified_pipeline(lambda b: (loose, None, None),
                                 lambda parts: pytest.fail("compiled a loose plan"), [])
    assert made.program is None and "compiled_stage_bytes" not in made.plan.measured


def test_stage_chunks_are_checked_with_their_device_group(gpt, monkeypatch):
    """Interleaved 1F1B's 4 chunks on 2 groups (chunks 0 and 2 on group 0). Each chunk's
    prediction is under `BINDING` of the budget, its group's is not, so the plan is compiled.
    Compiled, group 0 holds both chunks' parameters, data and accumulators, the larger of
    their working memories, and the most their microbatches keep at once under the table
    (5 of chunk 0's and chunk 2's, not their own peaks' 4 + 2); over the budget, the plan is
    re-planned at the group's predicted bytes scaled by budget / its compiled bytes."""
    *_, free, _ = gpt
    chunks = tuple(dataclasses.replace(free.stages[0], index=k, peak_memory_bytes=p)
                   for k, p in enumerate((450.0, 400.0, 460.0, 300.0)))
    plan = dataclasses.replace(free, memory_budget_bytes=1000.0, stages=chunks, pipeline={
        **free.pipeline, "schedule": "interleaved-1f1b", "num_microbatches": 8,
        "device_peak_bytes": [910.0, 700.0, 910.0, 700.0]})
    assert pmc.binding(plan) and not pmc.binding(      # the same stages, one per group
        dataclasses.replace(plan, pipeline={**plan.pipeline, "schedule": "1f1b"}))

    def memory(work0):
        return tuple(pmc.StageMemory(stage=k, held=100, data=10, accumulator=20, stash=50,
                                     in_flight=q, work=w, apply=30)
                     for k, (q, w) in enumerate(zip((4, 3, 2, 1), (work0, 40, 60, 40))))
    assert pmc.compiled_per_device(plan, memory(80)) == [
        2 * 130 + 80 + 5 * 50, 2 * 130 + 40 + 3 * 50] * 2
    assert [m.peak for m in memory(80)] == [410, 320, 290, 220]    # summed: 700 and 540
    rounds = iter([memory(500), memory(80)])
    monkeypatch.setattr(pmc, "stage_memory", lambda program, leaves, m: next(rounds))
    asked = []
    made = pmc.verified_pipeline(lambda b: asked.append(b) or (plan, None, None),
                                 lambda parts: "p", [])
    assert asked[1] == pytest.approx(910 * 1000 / (260 + 500 + 250), abs=1)
    assert made.plan.measured["compiled_stage_bytes"] == [410, 320, 290, 220]


def test_no_memory_analysis_keeps_the_plan(gpt, monkeypatch):
    *_, free, _ = gpt
    plan = dataclasses.replace(free, memory_budget_bytes=max(
        s.peak_memory_bytes for s in free.stages))
    monkeypatch.setattr(pmc, "stage_memory", lambda program, leaves, m: None)
    made = pmc.verified_pipeline(lambda b: (plan, None, None), lambda parts: "p", [])
    assert made.plan.measured["compiled_stage_bytes"] is None and made.program == "p"


def test_gradient_accumulation_is_checked_as_a_one_stage_pipeline():
    """ShardParallel(num_microbatches=2) runs as a one-stage pipeline: under a binding budget
    its executables are compiled and the plan records (and dumps) the stage's compiled peak;
    the step still equals jax.jit's."""
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(),
                                     value_and_grad=autopar.value_and_grad)
    free = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False,
                               method=autopar.ShardParallel(num_microbatches=2))
    predicted = free.get_plan(state, batches[0]).peak_memory_bytes
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False,
                              method=autopar.ShardParallel(
                                  num_microbatches=2, memory_budget_bytes=int(1.9 * predicted)))
    plan = par.get_plan(state, batches[0])
    got = plan.measured["compiled_stage_bytes"]
    assert len(got) == 1 and 0 < got[0] <= 1.9 * predicted
    assert "compiled by XLA to" in autopar.dump(plan)
    assert_equivalent(run_steps(jax.jit(step), state, batches), run_steps(par, state, batches),
                      compare_params=True)


def test_donated_state_is_updated_in_place_by_the_apply_segments(gpt):
    """With donate_argnums=(0,) the apply-gradient segments donate the old state that their
    new state replaces (lower_pipeline.donated_inputs): XLA aliases it (the apply phase holds
    one copy of the state, not two), the caller's buffers are consumed as under jax.jit, and
    the step still equals jax.jit's."""
    step, state, batches, _, ref = gpt
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(), plan_cache=False,
                              donate_argnums=(0,))
    par.get_plan(state, batches[0])
    program = par._entry_of((state, batches[0]))[0].executor.p
    calls, _ = compile_program(program, abstract_args(jax.tree.leaves((state, batches[0])),
                                                      program.in_shardings))
    aliased = {c.stage: c.compiled.memory_analysis().alias_size_in_bytes
               for c in calls if c.role is Role.APPLY
               and c.compiled.memory_analysis().alias_size_in_bytes > 0}
    assert set(aliased) == {0, 1}
    mine = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)
    with warnings.catch_warnings():      # every donated buffer is used
        warnings.filterwarnings("error", message=".*donated buffers were not usable")
        got = run_steps(par, mine, batches)
    assert jax.tree.leaves(mine.params)[0].is_deleted()
    assert_equivalent(ref, got, compare_params=True, smooth=True)
