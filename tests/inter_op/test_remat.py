"""Rematerialization choices applied to a loss's forward graph (`inter_op.remat`): which nodes
run under `jax.checkpoint`, with which policy, and the gradients they give; and pipelines
whose stages recompute (the DP's choice, a manual choice, the error without it)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.core.enums import Remat
from autopar.core.graph import RematRegion
from autopar.frontend.tracer import trace
from autopar.inter_op.remat import (
    CONCRETE,
    candidates,
    choices_of,
    policy_of,
    run_forward,
    with_remat,
)
from support.steps import assert_equivalent, long_lm_case, mesh_of, run_steps


def _mlp_loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return (x ** 2).mean()


def _forward():
    ws = [jnp.full((8, 8), 0.1 * (i + 1)) for i in range(3)]
    x = jnp.ones((4, 8))
    return trace(_mlp_loss, (ws, x)), (ws, x)


def test_remat_values_and_errors():
    assert Remat.of("full") is Remat.FULL and Remat("selective") is Remat.SELECTIVE
    with pytest.raises(autopar.InvalidArgumentError, match="remat='fast'.*'auto'"):
        Remat.of("fast")
    with pytest.raises(autopar.InvalidArgumentError, match="ShardParallel.remat"):
        autopar.ShardParallel(remat="partial")
    assert autopar.PipeshardParallel(remat="none").remat is Remat.NONE
    assert choices_of(Remat.AUTO) == CONCRETE and choices_of(Remat.FULL) == (Remat.FULL,)
    assert policy_of(Remat.SELECTIVE) is jax.checkpoint_policies.dots_saveable
    assert policy_of(Remat.FULL) is None
    with pytest.raises(autopar.InvalidArgumentError, match="one per stage"):
        autopar.ManualStageOption(layer_spans=((0, 0), (1, 1)), submesh_shapes=((1, 4), (1, 4)),
                                  logical_shapes=((1, 4), (1, 4)), remat=("full",))


def test_with_remat_marks_each_layer_and_keeps_the_users_regions():
    forward, _ = _forward()
    n = len(forward.nodes)
    bounds = (0, n // 2, n)
    out = with_remat(forward, bounds, (Remat.FULL, Remat.NONE))
    assert all(node.remat is not None and node.remat.policy is None
               for node in out.nodes[:n // 2])
    assert all(node.remat is None for node in out.nodes[n // 2:])
    assert forward.nodes[0].remat is None                  # the input graph is unchanged
    user = RematRegion(id=0, policy="mine", prevent_cse=False)
    import dataclasses
    mine = dataclasses.replace(forward, nodes=(dataclasses.replace(forward.nodes[0], remat=user),
                                               *forward.nodes[1:]))
    again = with_remat(mine, bounds, (Remat.SELECTIVE, Remat.SELECTIVE))
    assert again.nodes[0].remat is user                    # the user's checkpoint as written
    assert again.nodes[1].remat.policy is jax.checkpoint_policies.dots_saveable
    with pytest.raises(autopar.InvalidArgumentError, match="one per"):
        with_remat(forward, bounds, (Remat.FULL,))
    with pytest.raises(autopar.InvalidArgumentError, match="concrete"):
        with_remat(forward, bounds, (Remat.AUTO, Remat.NONE))


@pytest.mark.parametrize("choice", [Remat.SELECTIVE, Remat.FULL])
def test_rematerialized_forward_gives_the_same_gradient_behind_a_barrier(choice):
    forward, (ws, x) = _forward()
    n = len(forward.nodes)
    fwd = with_remat(forward, (0, n), (choice,))
    flat = [*ws, x]
    loss_of = lambda f: lambda *a: run_forward(f, *a)[0]
    ref = jax.grad(loss_of(forward), argnums=(0, 1, 2))(*flat)
    got = jax.grad(loss_of(fwd), argnums=(0, 1, 2))(*flat)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    text = jax.jit(jax.grad(loss_of(fwd))).lower(*flat).as_text()
    assert "optimization_barrier" in text                  # XLA keeps the recomputation
    plain = jax.jit(jax.grad(loss_of(forward))).lower(*flat).as_text()
    assert "optimization_barrier" not in plain


def test_candidates_from_least_recomputation_to_most():
    cands = candidates(2)
    assert cands[0] == (Remat.SELECTIVE, Remat.NONE) and cands[-1] == (Remat.FULL,) * 2
    assert len(cands) == 4 and len(set(cands)) == 4


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
