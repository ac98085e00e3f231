"""PipeshardParallel end to end on 8 simulated CPU devices: losses, gradients and parameters
over 3 steps equal plain `jax.jit` on one device (same tolerances and optimizer rule as the
ShardParallel equivalence tests, including `clip_by_global_norm`)."""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.core.spec import num_shards
from autopar.inter_op.pipeshard import accumulation_method
from autopar.models import make_mlp_batch
from autopar.models.gpt import GPTConfig
from autopar.models.lm1b import make_lm1b_batch, weighted_cross_entropy
from support.equivalence import assert_grads_close, assert_losses_close, assert_params_close
from support.steps import (
    LM1B,
    LM1B_LENGTHS,
    assert_equivalent,
    lm1b_state_and_batches,
    make_case,
    mesh_of,
    mlp_train_state,
    run_steps,
    sgd_momentum_clip,
    two_stages_2x2,
)

GPT_MARKED = GPTConfig(vocab_size=128, seq_len=16, num_layers=4, hidden=32, num_heads=4,
                       stage_boundaries=True)


def _check(model, api, method, *, tx=None, gpt_config=None, num_layers=4, batch_size=16):
    kw = dict(value_and_grad=autopar.value_and_grad, num_layers=num_layers,
              batch_size=batch_size)
    if gpt_config is not None:
        kw["gpt_config"] = gpt_config
    step, state, batches = make_case(model, api, tx or sgd_momentum_clip(), **kw)
    ref = run_steps(jax.jit(step), state, batches)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    got = run_steps(par, state, batches)
    assert_equivalent(ref, got, compare_params=True, rtol=2e-5, smooth=model == "gpt")
    return par, state, batches


def _method(stages, schedule, microbatches, layers=None):
    return autopar.PipeshardParallel(
        num_microbatches=microbatches, schedule=schedule,
        layer_option=layers or autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.UniformStageOption(num_stages=stages))


G, F = autopar.Schedule.GPIPE, autopar.Schedule.ONE_F_ONE_B


@pytest.mark.parametrize("stages,schedule,microbatches", [
    (2, F, 4), (2, G, 1), (4, G, 8), (4, F, 4), (2, F, 8), (4, G, 1)])
def test_mlp_pipeline_matches_single_device(stages, schedule, microbatches):
    par, state, batches = _check("mlp", "linen", _method(stages, schedule, microbatches))
    plan = par.get_plan(state, batches[0])
    assert len(plan.stages) == stages
    assert plan.pipeline["num_microbatches"] == microbatches
    # Stages sit on disjoint devices that together make the mesh.
    ids = [d for s in plan.stages for d in s.device_ids]
    assert sorted(ids) == list(range(8))


def test_adam_with_global_norm_clipping_is_exact_across_stages():
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    par, state, batches = _check("mlp", "linen", _method(2, F, 4), tx=tx)
    # The global norm needs every stage's gradients: the apply part runs in more than one
    # segment per stage.
    assert par.get_plan(state, batches[0]).pipeline["segments"] > 3


@pytest.mark.parametrize("api,stages,schedule,microbatches", [
    ("linen", 2, F, 4),
    # NNX pipelines: the MNIST step of test_nnx_grad.py; GPipe: the MLP pipelines here
    pytest.param("nnx", 2, G, 4, marks=pytest.mark.slow),
    pytest.param("linen", 4, F, 8, marks=pytest.mark.slow)])   # 4 stages: the MLP and manual GPT
def test_gpt_pipeline_matches_single_device(api, stages, schedule, microbatches):
    _check("gpt", api, _method(stages, schedule, microbatches))


@pytest.mark.slow      # manual layers: the MLP pipelines; GPT pipelines: the auto-layer cases
@pytest.mark.parametrize("stages", [4])
def test_gpt_manual_layers(stages):
    method = _method(stages, F, 4, layers=autopar.ManualLayerOption())
    par, state, batches = _check("gpt", "linen", method, gpt_config=GPT_MARKED)
    plan = par.get_plan(state, batches[0])
    assert plan.pipeline["num_layers"] == 4      # one layer per block
    scopes = " ".join(" ".join(s.scopes) for s in plan.stages)
    assert "block_0" in scopes and "block_3" in scopes


def test_sharding_rules_pin_every_stage():
    """Megatron's column/row split, pinned through `sharding_rules` in both stages of a 2-stage
    pipeline whose stages run on (2, 2) logical meshes, matches single-device training."""
    from autopar.models.gpt import megatron_rules
    method = two_stages_2x2(sharding_rules=megatron_rules())
    par, state, batches = _check("gpt", "linen", method, num_layers=2)
    plan = par.get_plan(state, batches[0])
    specs = {(t.path.removeprefix("state.params['params']"), t.stage): t.spec for t in plan.inputs
             if t.path.startswith("state.params")}
    for i in range(2):
        assert specs[(f"['block_{i}']['attn']['qkv']['kernel']", i)] == ((), (1,))
        assert specs[(f"['block_{i}']['mlp']['proj']['kernel']", i)] == ((1,), ())
        assert specs[(f"['block_{i}']['ln_2']['bias']", i)] == ((),)


def test_auto_stages_and_replay_from_plan():
    method = autopar.PipeshardParallel(num_microbatches=2, stage_option=autopar.AutoStageOption())
    par, state, batches = _check("mlp", "linen", method)
    plan = par.get_plan(state, batches[0])
    assert plan.pipeline["num_ilps"] > 0 and plan.pipeline["dp_candidates"] >= 1
    again = autopar.ParallelPlan.from_json(plan.to_json())
    assert again == plan
    replay = autopar.parallelize(par.__wrapped__, mesh=mesh_of((2, 4)), method=method, plan=again)
    from autopar.intra_op.solve import ILP_CALL
    solves = []
    token = ILP_CALL.set(lambda fn, *a, **k: solves.append(fn) or fn(*a, **k))
    try:
        replayed = replay.get_plan(state, batches[0])
    finally:
        ILP_CALL.reset(token)
    assert [s.layers for s in replayed.stages] == [s.layers for s in plan.stages]
    assert [s.device_ids for s in replayed.stages] == [s.device_ids for s in plan.stages]
    assert [s.logical_mesh_shape for s in replayed.stages] == \
        [s.logical_mesh_shape for s in plan.stages]
    # The saved stage solutions are replayed: no ILP is solved, and the replay trains as the
    # searched plan did (which equals jax.jit, checked by _check). The plan keeps the search's
    # record (its ILP count), not the replay's.
    assert solves == []
    assert replayed.pipeline["num_ilps"] == plan.pipeline["num_ilps"]
    assert replayed.pipeline["num_replayed"] == len(plan.stages)
    assert replayed.stage_solutions == plan.stage_solutions
    assert_equivalent(run_steps(par, state, batches), run_steps(replay, state, batches),
                      compare_params=True, rtol=1e-6)


def test_replay_solves_a_stage_whose_saved_solution_does_not_match(caplog):
    """A stage solution recorded for another stage graph, or one that cannot be read (a
    hand-edited or stale plan), is not trusted: that stage's ILP is solved again, with a
    warning, and the result is still exact."""
    method = _method(2, F, 2)
    par, state, batches = _check("mlp", "linen", method)
    plan = par.get_plan(state, batches[0])
    want = run_steps(par, state, batches)
    stale = [dict(r) for r in plan.stage_solutions]
    stale[1]["graph_fingerprint"] = "0" * 16
    broken = [dict(r) for r in plan.stage_solutions]
    del broken[0]["param_specs"]
    # (ParallelPlan.from_json refuses the broken record, tests/api/test_errors.py; a plan built in
    # memory can still carry one)
    for records, message in [(stale, "stage 1 of the saved plan was solved for another stage"),
                             (broken, "solution of stage 0 cannot be read (KeyError")]:
        edited = dataclasses.replace(plan, stage_solutions=tuple(records))
        if records is stale:
            edited = autopar.ParallelPlan.from_json(edited.to_json())
        replay = autopar.parallelize(par.__wrapped__, mesh=mesh_of((2, 4)), method=method,
                                     plan=edited)
        caplog.clear()
        with caplog.at_level("WARNING"):
            replayed = replay.get_plan(state, batches[0])
        assert message in caplog.text
        assert replayed.pipeline["num_replayed"] == 1 and replayed.pipeline["num_ilps"] >= 1
        assert_equivalent(want, run_steps(replay, state, batches), compare_params=True,
                          rtol=1e-6)


@pytest.mark.parametrize("schedule", [F, G])
def test_live_activations_per_stage(schedule):
    """Counted in the executor: 1F1B keeps at most S - s microbatches' residuals on stage s,
    GPipe keeps all M."""
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), num_layers=4,
                                     value_and_grad=autopar.value_and_grad)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(4, schedule, 8))
    par(state, batches[0])
    live = par.get_executor(state, batches[0]).stats.max_live_microbatches
    # Under 1F1B the last stage runs each microbatch's forward and backward as one call and
    # keeps nothing; under GPipe its backwards start after all its forwards.
    assert live == ([4, 3, 2, 0] if schedule is F else [8, 8, 8, 8])


def test_dump_shows_stages_and_schedule():
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), num_layers=4,
                                     value_and_grad=autopar.value_and_grad)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(2, F, 4))
    text = autopar.dump(par.get_plan(state, batches[0]))
    assert "pipeline: 2 stage(s) over 4 layer(s); schedule 1f1b, 4 microbatch(es)" in text
    assert "predicted bubble 20.0%" in text          # (S - 1) / (M + S - 1) = 1 / 5
    assert "0..3" in text and "4..7" in text         # each stage's devices


def test_step_without_autopar_grad_is_rejected():
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip())
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(2, F, 2))
    with pytest.raises(autopar.InvalidArgumentError, match="autopar.value_and_grad"):
        par(state, batches[0])


def test_microbatches_must_divide_the_batch():
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), batch_size=12,
                                     value_and_grad=autopar.value_and_grad)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(2, F, 8))
    with pytest.raises(autopar.InvalidArgumentError, match="num_microbatches=8"):
        par(state, batches[0])


def test_manual_layers_without_markers_is_rejected():
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(),
                                     value_and_grad=autopar.value_and_grad)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(
        2, F, 2, layers=autopar.ManualLayerOption()))
    with pytest.raises(autopar.InvalidArgumentError, match="mark_stage_boundary"):
        par(state, batches[0])


def _model_case(kind: str, *, stage_boundaries: bool):
    """(step, state, batches) for the MoE and Wide-ResNet families; step returns
    (state, loss, grads) and takes the gradient with autopar.value_and_grad."""
    from flax.training import train_state

    from autopar.models import (
        MoE,
        MoEConfig,
        WideResNet,
        WideResNetConfig,
        classification_loss,
        make_image_batch,
        make_moe_batch,
        moe_loss,
    )
    key = jax.random.key(0)
    if kind == "moe":
        cfg = MoEConfig(vocab_size=32, seq_len=8, num_layers=4, hidden=16, num_heads=2,
                        mlp_ratio=2, num_experts=4, capacity_factor=1.0,
                        stage_boundaries=stage_boundaries)
        model = MoE(cfg)
        batches = [make_moe_batch(jax.random.fold_in(key, i), 8, cfg) for i in range(3)]
        inputs = lambda b: b["tokens"]

        def loss_of(p, b):
            logits, aux = model.apply({"params": p}, b["tokens"], return_aux=True)
            return moe_loss(logits, b["tokens"], aux)
    else:
        cfg = WideResNetConfig(image_size=8, num_classes=10, depth=10, width=1,
                               base_channels=4, norm_groups=2, stage_boundaries=stage_boundaries)
        model = WideResNet(cfg)
        batches = [make_image_batch(jax.random.fold_in(key, i), 8, cfg) for i in range(3)]
        inputs = lambda b: b["images"]

        def loss_of(p, b):
            return classification_loss(model.apply({"params": p}, b["images"]), b["labels"])
    params = jax.jit(model.init)(jax.random.key(1), inputs(batches[0]))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=sgd_momentum_clip())

    def step(state, batch):
        loss, grads = autopar.value_and_grad(lambda p: loss_of(p, batch))(state.params)
        return state.apply_gradients(grads=grads), loss, grads
    return step, state, batches


# One case per model (35 s each on 2 cores): the schedules and stage counts they leave out are
# swept on GPT above; both models are planned on one mesh in tests/models, so these run in
# `make test-slow`.
@pytest.mark.slow
@pytest.mark.parametrize("kind,stages,schedule,microbatches,manual", [
    ("moe", 4, G, 2, False), ("wrn", 2, F, 4, True)])
def test_moe_and_wide_resnet_pipelines(kind, stages, schedule, microbatches, manual):
    step, state, batches = _model_case(kind, stage_boundaries=manual)
    ref = run_steps(jax.jit(step), state, batches)
    layers = autopar.ManualLayerOption() if manual else autopar.AutoLayerOption(num_layers=4)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=_method(stages, schedule, microbatches, layers=layers))
    got = run_steps(par, state, batches)
    assert_equivalent(ref, got, compare_params=True, rtol=2e-5)
    assert len(par.get_plan(state, batches[0]).stages) == stages


@pytest.mark.parametrize("stage_option", [autopar.AutoStageOption(),
                                          autopar.UniformStageOption(num_stages=2)])
def test_plan_that_cannot_fit_memory_says_how_much_it_needs(stage_option):
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), num_layers=4,
                                     value_and_grad=autopar.value_and_grad)
    method = autopar.PipeshardParallel(num_microbatches=2, memory_budget_bytes=1024,
                                       stage_option=stage_option)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    with pytest.raises(autopar.InfeasiblePlanError, match="memory_budget_bytes=1,024") as e:
        par(state, batches[0])
    assert e.value.budget_bytes == 1024 and e.value.needed_bytes > 1024


# Gradient accumulation: ShardParallel and its data / ZeRO variants with num_microbatches > 1
# run as a one-stage pipeline on the whole mesh.

@pytest.mark.parametrize("model,api,method", [     # NNX accumulation: also test_nnx_grad.py
    ("gpt", "linen", autopar.ShardParallel(num_microbatches=4)),
    pytest.param("gpt", "nnx", autopar.ShardParallel(num_microbatches=2),
                 marks=pytest.mark.slow),
    ("mlp", "linen", autopar.Zero3Parallel(num_microbatches=2)),
    ("mlp", "nnx", autopar.DataParallel(num_microbatches=2))])
def test_gradient_accumulation_matches_single_device(model, api, method):
    par, state, batches = _check(model, api, method, num_layers=2)
    plan = par.get_plan(state, batches[0])
    assert plan.method == method.kind.value and plan.pipeline["gradient_accumulation"]
    assert plan.pipeline["num_microbatches"] == method.num_microbatches
    (stage,) = plan.stages
    assert stage.device_ids == tuple(range(8)) and stage.logical_mesh_shape == (2, 4)
    live = par.get_executor(state, batches[0]).stats.max_live_microbatches
    assert live == [0]         # forward and backward in one call: no residuals kept
    if method.kind == autopar.MethodKind.ZERO3:       # the method's rules still hold
        params = [t for t in plan.inputs if t.role == "param" and t.shape]
        assert params and all(num_shards(t.spec, (2, 4)) == 8 for t in params)
    if method.kind == autopar.MethodKind.DATA:
        assert all(num_shards(t.spec, (2, 4)) == 1 for t in plan.inputs if t.role == "param")
    assert "gradient accumulation: " in autopar.dump(plan)


def test_gradient_accumulation_needs_less_memory():
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(), batch_size=64,
                                     value_and_grad=autopar.value_and_grad)
    peaks = [autopar.parallelize(step, mesh=mesh_of((2, 4)), method=autopar.ShardParallel(
        num_microbatches=m)).get_plan(state, batches[0]).peak_memory_bytes for m in (1, 4)]
    assert peaks[1] < peaks[0], peaks


def test_gradient_accumulation_needs_autopar_grad():
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip())
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=2))
    with pytest.raises(autopar.InvalidArgumentError, match="gradient accumulation"):
        par(state, batches[0])


def test_accumulation_method_mesh_shapes():
    cluster = autopar.ClusterSpec.preset("v100-p3.16xlarge", num_hosts=2)
    m = accumulation_method(autopar.Zero2Parallel(num_microbatches=4, memory_budget_bytes=2**30),
                            (16,), cluster)
    assert m.stage_option.logical_shapes == ((1, 16),)
    assert m.stage_option.submesh_shapes == ((2, 8),)       # the cluster's hosts x devices
    assert (m.num_microbatches, m.memory_budget_bytes) == (4, 2**30)
    assert accumulation_method(autopar.ShardParallel(num_microbatches=2), (2, 4),
                               cluster).stage_option.submesh_shapes == ((1, 8),)
    with pytest.raises(autopar.InvalidArgumentError, match="1-D or 2-D mesh"):
        accumulation_method(autopar.ShardParallel(num_microbatches=2), (2, 2, 2), cluster)


def test_remat_blocks_in_a_pipeline_match_single_device():
    """A loss of `jax.checkpoint`ed blocks (dots saveable) pipelined over 2 stages with 2
    microbatches: the stages differentiate the blocks under the user's checkpoint (see
    test_stages) and the numbers equal jax.jit's."""
    from support.stage_mlp import remat_step
    from support.steps import BATCH, PARAMS
    step = remat_step(jax.checkpoint_policies.dots_saveable)
    batches = [jax.tree_util.tree_map(lambda x, i=i: x * (1 + 0.1 * i), BATCH) for i in range(3)]

    def run(fn):
        params, out = PARAMS, []
        for b in batches:
            params, loss = fn(params, b)
            out.append((loss, params))
        return out

    method = autopar.PipeshardParallel(num_microbatches=2, layer_option=autopar.ManualLayerOption(),
                                       stage_option=autopar.UniformStageOption(num_stages=2))
    got = run(autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method))
    for (la, pa), (lb, pb) in zip(run(jax.jit(step)), got):
        np.testing.assert_allclose(float(lb), float(la), rtol=1e-5)
        for x, y in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)


# Flax-example-style steps (lm1b): a padding-weighted token loss sum(ce * w) / sum(w) with
# uneven padding, logits returned as aux and used in the metrics, a closed-over numpy
# position table, dropout drawing from an rng argument.

LM, LENGTHS = LM1B, LM1B_LENGTHS


def _lm1b_case(*, deterministic=True, value_and_grad=autopar.value_and_grad):
    """(step, state, batches, rng): `step(state, batch, rng) -> (state, metrics, grads)`."""
    state, batches = lm1b_state_and_batches(sgd_momentum_clip())

    def step(state, batch, dropout_rng):
        inputs, targets = batch["inputs"], batch["targets"]
        weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
        rng = jax.random.fold_in(dropout_rng, state.step)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, inputs, deterministic=deterministic,
                                    rngs={"dropout": rng})
            total, count = weighted_cross_entropy(logits, targets, weights)
            return total / count, logits
        (loss, logits), grads = value_and_grad(loss_fn, has_aux=True)(state.params)
        hits = (jnp.argmax(logits, -1) == targets) * weights      # full-batch logits
        metrics = {"loss": loss, "accuracy": hits.sum() / weights.sum(), "logits": logits}
        return state.apply_gradients(grads=grads), metrics, grads
    return step, state, batches, jax.random.PRNGKey(1)


def _run_with(step, state, batches, *extra):
    """(final state, per step (values, grads) as numpy) of `step(state, batch, *extra)`."""
    outs = []
    for b in batches:
        state, values, grads = step(state, b, *extra)
        outs.append(jax.tree_util.tree_map(np.asarray, (values, grads)))
    return state, outs


# Accumulation is slow here: make test runs the LM1B under it in
# test_lm1b_with_dropout_runs_under_gradient_accumulation.
@pytest.mark.parametrize("method", [
    pytest.param(autopar.ShardParallel(num_microbatches=4), marks=pytest.mark.slow),
    _method(2, F, 4)], ids=["accumulation", "pipeshard"])
def test_lm1b_padded_loss_and_logits_aux_match_single_device(method):
    """The padded token loss is weighted by each microbatch's token count (the mean of the
    microbatches' ratios would be off: checked below; a microbatch without tokens adds
    nothing, not 0 / 0), and the logits come back whole, in batch order, so metrics computed
    from them after the step match too."""
    assert not (np.asarray(make_lm1b_batch(jax.random.key(0), 8, LM, LENGTHS[2])["targets"])[
        1::4] > 0).any()
    step, state, batches, rng = _lm1b_case()
    ref_state, ref = _run_with(jax.jit(step), state, batches, rng)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    got_state, got = _run_with(par, state, batches, rng)
    # lm1b's MLP is ReLU (a routing model): values after step 0 are compared by the rule of
    # tests/support/equivalence.py
    for i, ((rm, rg), (gm, gg)) in enumerate(zip(ref, got)):
        assert gm["logits"].shape == rm["logits"].shape == (8, LM.seq_len, LM.vocab_size)
        assert_grads_close(rm["logits"], gm["logits"], step=i, what="logits")
        assert_grads_close(rm["accuracy"], gm["accuracy"], step=i, what="accuracy")
        assert_grads_close(rg, gg, step=i, rtol=2e-5)
    assert_losses_close([m["loss"] for m, _ in ref], [m["loss"] for m, _ in got])
    assert_params_close(ref_state.params, got_state.params, steps=len(batches), rtol=2e-5)
    # The test can fail: the mean of per-microbatch ratios (microbatch m holds examples m,
    # m + 4) is off the full batch's loss by 10x the tolerance above.
    targets = np.asarray(batches[0]["targets"])
    logits = ref[0][0]["logits"]
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, targets))
    w = (targets > 0).astype(np.float32)
    ratios = [(ce[m::4] * w[m::4]).sum() / w[m::4].sum() for m in range(4)]
    assert abs(np.mean(ratios) - ref[0][0]["loss"]) > 1e-4 * ref[0][0]["loss"]
    assert par.get_plan(state, batches[0], rng).pipeline["microbatch_combine"] == [
        "ratio", "concat"]


def test_lm1b_with_dropout_runs_under_gradient_accumulation():
    """Dropout masks are drawn per microbatch, so the step cannot equal the single-device one:
    it runs, drops, returns whole logits, and microbatch m draws from fold_in(key, m): two
    identical examples in two microbatches (at the same row) get different masks."""
    step, state, batches, rng = _lm1b_case(deterministic=False)
    batch = jax.tree_util.tree_map(lambda x: x.at[1].set(x[0]), batches[0])   # 1 is 0 again
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=4))
    with warnings.catch_warnings():      # random bits at the microbatch's shape are exact
        warnings.simplefilter("error", autopar.MicrobatchReductionWarning)
        _, got = _run_with(par, state, [batch], rng)
    plan = par.get_plan(state, batch, rng)
    assert plan.pipeline["microbatch_combine"] == ["ratio", "concat"]
    assert "loss outputs over microbatches: ratio, concat" in autopar.dump(plan)
    det_step, *_ = _lm1b_case(deterministic=True)
    _, ref = _run_with(jax.jit(det_step), state, [batch], rng)
    ((metrics, grads),) = got
    logits = metrics["logits"]
    assert logits.shape == (8, LM.seq_len, LM.vocab_size)
    assert np.isfinite(metrics["loss"]) and abs(metrics["loss"] - ref[0][0]["loss"]) > 1e-4
    assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))
    assert np.abs(logits[0] - logits[1]).max() > 1e-3       # different masks
    np.testing.assert_allclose(ref[0][0]["logits"][0], ref[0][0]["logits"][1], rtol=1e-6)


def test_lm1b_with_jax_value_and_grad_names_the_fix():
    step, state, batches, rng = _lm1b_case(value_and_grad=jax.value_and_grad)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=4))
    with pytest.raises(autopar.InvalidArgumentError,
                       match=r"jax.value_and_grad and nnx.value_and_grad do not count"
                             r".*autopar.value_and_grad"):
        par(state, batches[0], rng)


def _mlp_sum_case(loss_of):
    """(step, state, batches) of a linen MLP whose loss is `loss_of(squared error [B, H], y)`."""
    state = mlp_train_state(16, 16, sgd_momentum_clip())
    key = jax.random.key(3)
    batches = [make_mlp_batch(jax.random.fold_in(key, i), 16, 16, 16) for i in range(3)]

    def step(state, batch):
        def loss_fn(p):
            out = state.apply_fn({"params": p}, batch["x"])
            return loss_of((out - batch["y"]) ** 2, batch["y"])
        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, grads
    return step, state, batches


@pytest.mark.parametrize("method", [autopar.ShardParallel(num_microbatches=4), _method(2, F, 4)],
                         ids=["accumulation", "pipeshard"])
def test_sum_reduced_loss_is_summed_over_microbatches(method):
    """`jnp.sum(per_example)`: the microbatches' losses and gradients are summed (averaging
    them would train on a quarter of the gradient)."""
    step, state, batches = _mlp_sum_case(lambda err, y: jnp.sum(err))
    ref = run_steps(jax.jit(step), state, batches)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True, rtol=2e-5)
    assert par.get_plan(state, batches[0]).pipeline["microbatch_combine"] == ["sum"]


def test_a_token_count_made_in_the_step_is_read_whole_by_every_microbatch():
    """`sum(l * w) / count` with `count = w.sum()` computed before the loss and closed over:
    it has no batch dimension, so every microbatch divides by the whole batch's count (it
    was refused as a loss input that cannot be split) and the losses are summed."""
    state = mlp_train_state(16, 16, sgd_momentum_clip())
    batches = [make_mlp_batch(jax.random.fold_in(jax.random.key(5), i), 16, 16, 16)
               for i in range(3)]

    def step(state, batch):
        w = (batch["y"][:, 0] > 0).astype(jnp.float32)
        count = w.sum()

        def loss_fn(p):
            err = (state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2
            return jnp.sum(err.sum(-1) * w) / count
        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, grads
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=4))
    assert_equivalent(run_steps(jax.jit(step), state, batches), run_steps(par, state, batches),
                      compare_params=True, rtol=2e-5)
    assert par.get_plan(state, batches[0]).pipeline["microbatch_combine"] == ["sum"]


@pytest.mark.parametrize("method", [autopar.ShardParallel(num_microbatches=4), _method(2, G, 4)],
                         ids=["accumulation", "pipeshard"])
def test_auxiliary_outputs_combine_like_the_full_batch(method):
    """A padded-ratio loss with aux: per-example values (in batch order), a ratio with its own
    denominator, an integer count and a mean, all equal to the single-device step's."""
    def loss_and_aux(err, y):
        w, w2 = (y[:, 0] > 0).astype(jnp.float32), (y[:, 1] > 0.5).astype(jnp.float32)
        per_example = err.sum(-1)
        return jnp.sum(per_example * w) / jnp.sum(w), {
            "per_example": per_example, "ratio": jnp.sum(per_example * w2) / jnp.sum(w2),
            "count": jnp.sum(per_example > 1.0), "mean": jnp.mean(err)}
    state = mlp_train_state(16, 16, sgd_momentum_clip())
    batches = [make_mlp_batch(jax.random.fold_in(jax.random.key(4), i), 16, 16, 16)
               for i in range(3)]

    def step(state, batch):
        def loss_fn(p):
            return loss_and_aux((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2,
                                batch["y"])
        (loss, aux), grads = autopar.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), (loss, aux), grads
    # Some microbatch has no example with w2 = 1: its ratio is 0 / 0 and must weigh nothing.
    assert any(not (np.asarray(b["y"])[m::4, 1] > 0.5).any() for b in batches for m in range(4))
    ref_state, ref = _run_with(jax.jit(step), state, batches)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    got_state, got = _run_with(par, state, batches)
    for i, (((rl, ra), _rg), ((gl, ga), _gg)) in enumerate(zip(ref, got)):
        assert ra["count"].dtype == ga["count"].dtype
        if i == 0:                   # a threshold count is exact where the parameters are
            assert ra["count"] == ga["count"]
        assert_grads_close((rl, ra), (gl, ga), step=i, what="loss and aux")   # ReLU MLP
    assert_equivalent((ref_state, [v[0][0] for v in ref], [v[1] for v in ref]),
                      (got_state, [v[0][0] for v in got], [v[1] for v in got]),
                      compare_params=True, rtol=2e-5)
    assert par.get_plan(state, batches[0]).pipeline["microbatch_combine"] == [
        "ratio", "sum", "mean", "concat", "ratio"]


def test_a_loss_that_cannot_be_made_exact_warns():
    """The log of a weighted sum over examples is no mean, sum or ratio of them: the loss is
    averaged over microbatches, and the warning names the rule, the loss line and the fix.
    (A clamped denominator, jnp.maximum(sum(w), 1), is exact: tests/api/
    test_microbatch_denominators.py.)"""
    def log_of_sum(err, y):
        w = (y[:, 0] > 0).astype(jnp.float32)
        return jnp.log1p(jnp.sum(err.sum(-1) * w))
    step, state, batches = _mlp_sum_case(log_of_sum)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=4))
    with pytest.warns(autopar.MicrobatchReductionWarning,
                      match=r"num_microbatches=4: the loss .*test_pipeshard.py:\d+.*`log1p`.*"
                            r"and so is its gradient.*Fix: .*sum\(l \* w\) / sum\(w\)"):
        plan = par.get_plan(state, batches[0])
    assert plan.pipeline["microbatch_combine"] == ["unknown"]
