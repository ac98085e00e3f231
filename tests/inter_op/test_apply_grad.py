"""Apply-gradient placement (`inter_op.apply_grad.place`): the stage and sharding of every step
input, the segments the step runs in (the pipelined loss, then per-stage optimizer pieces;
global-norm clipping adds segments), optimizer state following its parameter's spec."""
import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar
from autopar.core.graph import InputRole, TensorKind
from autopar.core.spec import replicated
from autopar.cost.cluster import ClusterSpec
from autopar.frontend.grad import VALUE_AND_GRAD
from autopar.frontend.tracer import trace
from autopar.inter_op.apply_grad import PIPELINE, place
from autopar.inter_op.pipeline import layer_boundaries, split_step
from autopar.inter_op.stages import choose_stages
from support.steps import BATCH, PARAMS, marked_layers  # four 16 x 16 layers, a batch of 8


def loss_fn(p, x, y):
    """Four marked layers; l0 is tied into the last layer."""
    h = marked_layers(p, x)
    return jnp.mean((h @ p["l0"].T - y) ** 2)


def pieces(tx, num_stages=2):
    """(loss graph, chosen stages) of an optax step on 8 devices with uniform stages."""
    def step(state, batch):
        params, opt_state = state
        loss, grads = autopar.value_and_grad(loss_fn)(params, batch["x"], batch["y"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    state = (PARAMS, tx.init(PARAMS))
    graph = trace(step, (state, BATCH), batch_argnums=(1,), keep_grad=True)
    loss = split_step(graph, graph, 1)
    bounds = layer_boundaries(loss.forward, autopar.ManualLayerOption())
    method = autopar.PipeshardParallel(
        layer_option=autopar.ManualLayerOption(),
        stage_option=autopar.UniformStageOption(num_stages=num_stages))
    result = choose_stages(loss, bounds, ClusterSpec.from_devices(jax.devices()[:8]),
                           tuple(range(8)), method)
    return loss, result.stages


def inputs_by_path(step):
    return {step.tensors[t].path: pos for pos, t in enumerate(step.inputs)}


@pytest.fixture(scope="module")
def momentum():
    return pieces(optax.sgd(0.1, momentum=0.9))


@pytest.fixture(scope="module")
def clipped_adam():
    return pieces(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))


def check_segments(step, segments):
    """Every node in exactly one segment, and every segment reads only step inputs,
    constants and values made by earlier segments."""
    seen = [n for seg in segments for n in seg.nodes]
    assert sorted(seen) == list(range(len(step.nodes)))
    ready = set(step.inputs)
    for seg in segments:
        for nid in seg.nodes:
            for t in step.nodes[nid].inputs:
                made_here = any(t in step.nodes[m].outputs for m in seg.nodes)
                assert (t in ready or made_here
                        or step.tensors[t].kind == TensorKind.CONST), (seg.stage, t)
        assert all(t in ready for t in seg.inputs)
        ready.update(seg.outputs)
    assert all(t in ready for t in step.outputs)


def test_parameters_and_their_optimizer_state_live_on_the_stage_using_them(momentum):
    loss, stages = momentum
    pl = place(loss, stages)
    step = loss.step
    by_path = inputs_by_path(step)
    assert len(pl.input_stage) == len(pl.input_spec) == len(step.inputs)
    stage_of = lambda suffix, role: [pl.input_stage[p] for path, p in by_path.items()
                                     if path.endswith(suffix)
                                     and step.tensors[step.inputs[p]].role == role]
    # l0 is read by both stages; it lives on the first one
    for i, want in enumerate([0, 0, 1, 1]):
        assert stage_of(f"['l{i}']", InputRole.PARAM) == [want]
        assert stage_of(f"['l{i}']", InputRole.OPT_STATE) == [want]     # momentum trace
    assert pl.input_stage[by_path["batch['x']"]] == 0
    assert pl.input_stage[by_path["batch['y']"]] == 1


def test_loss_input_stages(momentum):
    loss, stages = momentum
    pl = place(loss, stages)
    # loss inputs: l0..l3, x, y
    assert pl.loss_input_stages == ((0, 1), (0,), (1,), (1,), (0,), (1,))


def test_segments_without_a_global_reduction(momentum):
    loss, stages = momentum
    pl = place(loss, stages)
    step = loss.step
    first = pl.segments[0]
    assert first.stage == PIPELINE
    assert [step.nodes[n].primitive for n in first.nodes] == [VALUE_AND_GRAD]
    # the gradients leave the pipeline; each stage then updates its own parameters once
    assert [s.stage for s in pl.segments] in ([PIPELINE, 0, 1], [PIPELINE, 1, 0])
    check_segments(step, pl.segments)
    grad_outs = step.nodes[loss.grad_node].outputs[1:]
    assert set(grad_outs) <= set(first.outputs)


def test_global_norm_clipping_adds_segments(clipped_adam):
    loss, stages = clipped_adam
    pl = place(loss, stages)
    check_segments(loss.step, pl.segments)
    assert pl.segments[0].stage == PIPELINE
    assert sum(s.stage == PIPELINE for s in pl.segments) == 1
    # partial norms per stage, then the norm, then the updates: more than one per stage
    assert len(pl.segments) > 1 + len(stages)
    assert {s.stage for s in pl.segments[1:]} == {0, 1}
    # adam's mu and nu of a parameter sit with the parameter
    by_path = inputs_by_path(loss.step)
    for i, want in enumerate([0, 0, 1, 1]):
        stages_i = {pl.input_stage[p] for path, p in by_path.items()
                    if path.endswith(f"['l{i}']")}
        assert stages_i == {want}


def test_carried_outputs_keep_their_input_placement(clipped_adam):
    loss, stages = clipped_adam
    pl = place(loss, stages)
    step = loss.step
    assert step.carried_outputs                      # new params and optimizer state
    for out_pos, in_pos in step.carried_outputs.items():
        assert pl.output_stage[out_pos] == pl.input_stage[in_pos]
        assert pl.output_spec[out_pos] == pl.input_spec[in_pos]
    # the loss is not carried: made on the last stage, sharding left as made
    loss_pos = len(step.outputs) - 1
    assert loss_pos not in step.carried_outputs
    assert pl.output_stage[loss_pos] == 1 and pl.output_spec[loss_pos] is None


def test_optimizer_state_takes_its_parameters_spec(clipped_adam):
    """Pin a sharded spec on l1 (stage 0) and l2 (stage 1): adam's mu and nu of those
    parameters follow it, the others stay replicated."""
    loss, stages = clipped_adam
    s0, s1 = stages
    col, row = ((), (1,)), ((0,), ())
    pinned = (dataclasses.replace(s0, solution=dataclasses.replace(
                  s0.solution, param_specs=(replicated(2), col))),
              dataclasses.replace(s1, solution=dataclasses.replace(
                  s1.solution, param_specs=(replicated(2), row, replicated(2)))))
    assert s0.slice.param_inputs == (0, 1) and s1.slice.param_inputs == (0, 2, 3)
    pl = place(loss, pinned)
    step, by_path = loss.step, inputs_by_path(loss.step)
    want = {"l0": replicated(2), "l1": col, "l2": row, "l3": replicated(2)}
    checked = 0
    for path, pos in by_path.items():
        t = step.tensors[step.inputs[pos]]
        for name, spec in want.items():
            if path.endswith(f"['{name}']") and t.role in (InputRole.PARAM, InputRole.OPT_STATE):
                assert pl.input_spec[pos] == spec, path
                checked += 1
    assert checked == 4 * 3                  # param, mu and nu of each of the four weights
    # batch inputs keep the stages' data specs
    assert pl.input_spec[by_path["batch['x']"]] == s0.solution.data_specs[0]


def test_sharding_rules_pin_optimizer_state_in_a_pipeline():
    """A `sharding_rules` entry for optimizer state holds in a pipeline: the leaf is placed,
    updated and returned on that sharding (the update of a stage's state runs outside the
    stage ILP, in the apply-gradient segments)."""
    import numpy as np

    from support.steps import mesh_of
    tx = optax.adam(1e-2)

    def step(state, batch, vg=autopar.value_and_grad):
        params, opt_state = state
        loss, grads = vg(loss_fn)(params, batch["x"], batch["y"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    method = autopar.PipeshardParallel(
        num_microbatches=2, sharding_rules=((r"\.mu\['l1'\]", (None, "model")),),
        layer_option=autopar.ManualLayerOption(),
        stage_option=autopar.UniformStageOption(num_stages=2))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    state = (PARAMS, tx.init(PARAMS))
    plan = par.get_plan(state, BATCH)
    mu = [t for t in plan.inputs if ".mu['l1']" in t.path]
    assert [t.spec for t in mu] == [((), (1,))]
    others = [t for t in plan.inputs if ".mu['l2']" in t.path]
    assert others and not any(others[0].spec)        # no rule: follows its parameter
    got = par(state, BATCH)
    leaf = got[0][1][0].mu["l1"]
    assert leaf.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    ref = jax.jit(lambda s, b: step(s, b, jax.value_and_grad))(state, BATCH)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(ref[0]), jax.tree_util.tree_leaves(got[0])):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
