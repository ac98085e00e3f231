"""Pipelines whose stages recompute (`step_remat` on each stage's training graph): the DP's
choice, a manual choice, the error without it."""
import pytest

import autopar
from support.steps import assert_equivalent, long_lm_case, mesh_of, run_steps

# --- pipelines: each stage's remat is the search's (or the user's) choice -------------------

@pytest.fixture(scope="module")
def long_lm():
    return long_lm_case()


def _pipe(remat, budget=None, stage_option=None):
    return autopar.PipeshardParallel(
        num_microbatches=2, layer_option=autopar.AutoLayerOption(num_layers=2),
        stage_option=stage_option or autopar.UniformStageOption(num_stages=2), remat=remat,
        memory_budget_bytes=budget)


@pytest.fixture(scope="module")
def least(long_lm) -> int:
    """The least memory any plan of the 2-stage layout needs without recomputation."""
    step, state, batches, _ = long_lm
    with pytest.raises(autopar.InfeasiblePlanError) as tiny:
        autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe("none", 1000)).get_plan(
            state, batches[0])
    return tiny.value.needed_bytes


def test_two_stage_pipeline_recomputes_to_fit_70_percent_of_its_least_memory(long_lm, least):
    """Acceptance: with a budget of 70% of the least memory any plan of the 2-stage layout
    needs without recomputation, remat='none' raises carrying that least; the default search
    recomputes where it must, its predicted peak fits, and it trains like jax.jit."""
    step, state, batches, ref = long_lm
    mesh = mesh_of((2, 4))
    budget = int(0.7 * least)
    with pytest.raises(autopar.InfeasiblePlanError, match="remat") as e:
        autopar.parallelize(step, mesh=mesh, method=_pipe("none", budget)).get_plan(
            state, batches[0])
    assert e.value.needed_bytes == least
    par = autopar.parallelize(step, mesh=mesh, method=_pipe("auto", budget))
    plan = par.get_plan(state, batches[0])
    assert plan.peak_memory_bytes <= budget
    assert any(s.remat != "none" for s in plan.stages)
    assert max(s.peak_memory_bytes for s in plan.stages) <= budget
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True, rtol=2e-5,
                      smooth=True)
    # The choice is recorded, replayable, and shown.
    assert plan.stage_option().remat == tuple(s.remat for s in plan.stages)
    again = autopar.ParallelPlan.from_json(plan.to_json())
    assert [s.remat for s in again.stages] == [s.remat for s in plan.stages]
    assert "remat" in autopar.dump(plan)


def test_recomputing_stages_keep_fewer_activations(long_lm):
    step, state, batches, _ = long_lm
    acts = {}
    for remat in ("none", "selective", "full"):
        plan = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(remat)).get_plan(
            state, batches[0])
        assert [s.remat for s in plan.stages] == [remat] * 2
        acts[remat] = [s.activation_bytes for s in plan.stages]
        lat = [s.latency_s for s in plan.stages]
        acts[remat + "_lat"] = lat
    for p in range(2):
        assert acts["full"][p] < acts["selective"][p] < acts["none"][p]
        assert acts["none_lat"][p] < acts["full_lat"][p]      # recomputing costs time


@pytest.mark.slow      # recomputing stages under a binding budget: the 70% test above (make test)
def test_auto_stage_search_chooses_remat_when_memory_binds(long_lm, least):
    # 58% of the 2-stage layout's least: one stage on the whole mesh without recomputation
    # needs about 60% of it (intra_op/memory.py), so only recomputing stages fit.
    step, state, batches, ref = long_lm
    budget = int(0.58 * least)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(
        "auto", budget, autopar.AutoStageOption(logical_shapes="flat")))
    plan = par.get_plan(state, batches[0])
    assert any(s.remat != "none" for s in plan.stages)
    assert plan.peak_memory_bytes <= budget
    for st in plan.stages:       # what recomputing saves, as the search priced it
        if st.remat != "none":
            assert st.activation_bytes_without_remat > st.activation_bytes
    assert 'class="saved"' in autopar.report(plan)
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True, rtol=2e-5,
                      smooth=True)
    # No stage recomputes more than it must: the same layout with one stage recomputing less
    # does not fit, or is not faster (the DP prices layers' fastest and leanest plans; the
    # whole-stage solve may take a plan of less recomputation that fits the schedule).
    order = ["none", "selective", "full"]
    for i, st in enumerate(plan.stages):
        for lighter in order[:order.index(st.remat)]:
            remats = tuple(lighter if j == i else s.remat for j, s in enumerate(plan.stages))
            manual = autopar.ManualStageOption(
                layer_spans=tuple(tuple(s.layers) for s in plan.stages),
                submesh_shapes=tuple(tuple(s.submesh) for s in plan.stages),
                logical_shapes=tuple(tuple(s.logical_mesh_shape) for s in plan.stages),
                remat=remats, zero=tuple(s.zero for s in plan.stages))
            try:
                other = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_pipe(
                    "auto", budget, manual)).get_plan(state, batches[0])
            except autopar.InfeasiblePlanError:
                continue
            assert other.predicted_step_s >= plan.predicted_step_s * (1 - 1e-6), (i, lighter)
