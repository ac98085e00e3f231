"""Forward-only pipelines (issue 27, item 4): a step without a gradient (an eval step, a
batched forward) under `PipeshardParallel` runs as forward stages only, microbatches streamed
through them (`Schedule.FORWARD`) and each output combined back into the whole batch's (rows
in batch order, means averaged); it equals `jax.jit` on 8 simulated CPU devices, keeps
nothing for a backward, and a model too large for one submesh's budget fits the pipeline."""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import autopar
from autopar.core.errors import InfeasiblePlanError, InvalidArgumentError
from autopar.inter_op.schedule import Phase
from autopar.models.gpt import GPT, GPTConfig, NnxGPT, gpt_loss, make_gpt_batch
from autopar.models.mlp import MLP, make_mlp_batch, mse_loss
from autopar.runtime.compile_only import Role, abstract_args, compile_program
from autopar.verify.pipeline_memory_check import stage_memory
from support.hlo import hlo_collectives
from support.steps import mesh_of

CFG = GPTConfig(vocab_size=128, seq_len=16, num_layers=4, hidden=32, num_heads=4)


def _method(stages=4, microbatches=4, layers=4, **kw):
    return autopar.PipeshardParallel(
        num_microbatches=microbatches, layer_option=autopar.AutoLayerOption(num_layers=layers),
        stage_option=autopar.UniformStageOption(num_stages=stages), **kw)


def _gpt_eval():
    """(eval_step, state, batch): a linen GPT in a TrainState with Adam's state (which the
    eval never reads), returning logits, mean loss, accuracy and integer predictions."""
    net = GPT(CFG)
    batch = make_gpt_batch(jax.random.key(1), 16, CFG)
    params = net.init(jax.random.key(0), batch["tokens"])
    state = train_state.TrainState.create(apply_fn=net.apply, params=params,
                                          tx=optax.adam(1e-3))

    def eval_step(state, batch):
        logits = state.apply_fn(state.params, batch["tokens"])
        preds = jnp.argmax(logits, -1)
        accuracy = jnp.mean(preds[:, :-1] == batch["tokens"][:, 1:])
        return {"logits": logits, "loss": gpt_loss(logits, batch["tokens"]),
                "accuracy": accuracy, "predictions": preds}
    return eval_step, state, batch


def _assert_close(want, got, rtol=1e-5):
    for path, w in jax.tree_util.tree_leaves_with_path(want):
        g = np.asarray(dict(jax.tree_util.tree_leaves_with_path(got))[path])
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * max(np.abs(w).max(), 1.0),
                                   err_msg=jax.tree_util.keystr(path))


def test_a_4_stage_gpt_eval_step_equals_jit_and_runs_forwards_only():
    eval_step, state, batch = _gpt_eval()
    want = jax.jit(eval_step)(state, batch)
    par = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=_method())
    got = par(state, batch)
    _assert_close(want, got)
    assert np.array_equal(got["predictions"], want["predictions"])   # ints: exactly
    plan = par.get_plan(state, batch)
    assert plan.pipeline["schedule"] == "forward" and plan.pipeline["forward_only"]
    assert len(plan.stages) == 4 and plan.pipeline["in_flight"] == [0, 0, 0, 0]
    # each output combined as the graph shows: rows back in batch order, means averaged
    assert plan.pipeline["microbatch_combine"] == ["mean", "concat", "mean", "concat"]
    ex = par.get_executor(state, batch)
    assert {t.phase for t in ex.stats.order} == {Phase.FORWARD}
    assert tuple(ex.stats.order) == ex.p.schedule.order()       # the table's order, run
    assert ex.stats.max_live_microbatches == [0] * 4               # nothing kept
    assert all(st.backward is None and st.fused is None for st in ex.p.stages)
    # a stage's graph is its forward (outputs: the stage's, no gradients), and its memory
    # counts no accumulator or optimizer state (Adam's is in the state, never read)
    for st in ex.p.stages:
        assert len(st.graph.outputs) == len(st.io.float_outputs) + len(st.io.int_outputs)
    assert [r["trains"] for r in plan.stage_solutions] == [False] * 4
    _assert_close(want, par(state, batch))        # a second call: no re-plan, same values
    # the plan saved as JSON replays (its stages from their saved solutions)
    replay = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=_method(),
                                 plan=autopar.ParallelPlan.from_json(plan.to_json()))
    _assert_close(want, replay(state, batch))
    assert replay.get_plan(state, batch).origin == "saved plan"


def _train_step(state, batch):
    loss, grads = autopar.value_and_grad(
        lambda p: gpt_loss(state.apply_fn(p, batch["tokens"]), batch["tokens"]))(state.params)
    return state.apply_gradients(grads=grads), loss


def test_eval_stages_compile_to_forwards_that_keep_nothing_and_need_less_than_training():
    """The same GPT on the same 2 stages and microbatches, as an eval step and as a train
    step: the eval's compiled stages are forwards returning their outputs alone (no
    residuals, no accumulator, no gradient all-reduce), and each stage's compiled peak is
    below the training stage's."""
    eval_step, state, batch = _gpt_eval()
    leaves = jax.tree_util.tree_leaves((state, batch))
    mems, calls_of = [], []
    for step in (eval_step, _train_step):
        par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(2, 2))
        par(state, batch)
        program = par.get_executor(state, batch).p
        calls, _ = compile_program(program, abstract_args(leaves, program.in_shardings))
        calls_of.append(calls)
        mems.append(stage_memory(program, leaves, 2))
    (ev_calls, tr_calls), (ev_mem, tr_mem) = calls_of, mems
    ev_roles = {c.role for c in ev_calls if c.stage is not None}
    assert ev_roles == {Role.FORWARD}, ev_roles
    assert Role.FUSED in {c.role for c in tr_calls}
    assert all(c.outs[2] == [] for c in ev_calls if c.role is Role.FORWARD)
    assert any(c.outs[2] for c in tr_calls if c.role is Role.FORWARD)   # stage 0 keeps some
    for c in ev_calls:
        if c.role is Role.FORWARD:
            kinds = {k for k, _ in hlo_collectives(c.compiled.as_text())}
            assert "all-reduce" not in kinds or c.stage == 1, (c.stage, kinds)  # no grads
    for e, t in zip(ev_mem, tr_mem):
        assert e.accumulator == e.stash == e.in_flight == 0
        assert t.accumulator > 0
        assert e.peak < t.peak, (e, t)


def test_an_nnx_eval_step_runs_by_swapping_the_decorator():
    model = NnxGPT(CFG, rngs=nnx.Rngs(0))
    batch = make_gpt_batch(jax.random.key(1), 16, CFG)

    def eval_step(model, batch):
        logits = model(batch["tokens"])
        return logits, gpt_loss(logits, batch["tokens"])

    want = nnx.jit(eval_step)(model, batch)
    got = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=_method(2, 4))(
        model, batch)
    _assert_close(want, got)


@pytest.mark.parametrize("method", [autopar.ShardParallel(num_microbatches=4),
                                    autopar.Zero3Parallel(num_microbatches=2)])
def test_microbatched_eval_on_one_mesh_is_one_executable_equal_to_jit(method):
    """`ShardParallel(num_microbatches=M)` (and the data-parallel methods) on an eval step:
    the batch through one stage in M pieces, one microbatch's activations at a time, as one
    executable (a scan of the stage's forward, no accumulator)."""
    eval_step, state, batch = _gpt_eval()
    par = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=method)
    _assert_close(jax.jit(eval_step)(state, batch), par(state, batch))
    plan = par.get_plan(state, batch)
    assert plan.pipeline["forward_only"] and plan.pipeline["schedule"] == "forward"
    assert plan.pipeline["one_executable"]
    ex = par.get_executor(state, batch)
    assert ex.p.whole_step is not None and ex.stats.num_dispatches == 1
    assert "all in one executable" in autopar.dump(plan)


def _mlp_eval(hidden=256, layers=4, batch_size=64):
    net = MLP(num_layers=layers, hidden=hidden)
    batch = make_mlp_batch(jax.random.key(1), batch_size, hidden, hidden)
    params = net.init(jax.random.key(0), batch["x"])

    def eval_step(params, batch):
        out = net.apply(params, batch["x"])
        return out, mse_loss(out, batch["y"])
    return eval_step, params, batch


def test_a_model_too_large_for_one_submesh_plans_and_runs_as_a_pipeline():
    eval_step, params, batch = _mlp_eval()
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))    # ~1 MiB
    budget = int(0.4 * param_bytes)
    # one 2-device submesh cannot hold the model within the budget: at least half of it
    # per device, whatever the sharding
    with pytest.raises(InfeasiblePlanError, match="bytes"):
        autopar.parallelize(eval_step, mesh=mesh_of((1, 2)), plan_cache=False,
                            method=autopar.ShardParallel(memory_budget_bytes=budget))(
                                params, batch)
    # four stages of one layer each on 2 devices apiece fit
    par = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)),
                              method=_method(4, 4, memory_budget_bytes=budget))
    _assert_close(jax.jit(eval_step)(params, batch), par(params, batch))
    plan = par.get_plan(params, batch)
    assert len(plan.stages) == 4
    assert all(s.peak_memory_bytes <= budget for s in plan.stages)
    assert all(len(s.device_ids) == 2 for s in plan.stages)
    # the compiled stages, as XLA counts them, fit the budget too
    program = par.get_executor(params, batch).p
    peaks = [m.peak for m in stage_memory(program, jax.tree_util.tree_leaves((params, batch)),
                                          4)]
    assert max(peaks) <= budget, (peaks, budget)


def test_the_forward_schedule_is_refused_for_a_step_that_takes_a_gradient():
    eval_step, state, batch = _gpt_eval()
    par = autopar.parallelize(_train_step, mesh=mesh_of((2, 4)), plan_cache=False,
                              method=_method(2, 2, schedule=autopar.Schedule.FORWARD))
    with pytest.raises(InvalidArgumentError, match=r"Schedule.FORWARD\) runs forwards only.*"
                       r"Fix: a training schedule"):
        par(state, batch)
    # an eval step under any schedule runs forwards only
    got = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=dataclasses.replace(
        _method(2, 2), schedule=autopar.Schedule.ZERO_BUBBLE_H1))(state, batch)
    _assert_close(jax.jit(eval_step)(state, batch), got)


@pytest.mark.parametrize("train", [False, True])
def test_a_scanned_stack_with_a_padded_loss_combines_exactly(train):
    """A layer stack under `jax.lax.scan` (cut into sub-scans across 4 stages), a closed-over
    numpy table and a padded loss `sum(l * m) / max(sum(m), 1)`: the loss is a ratio (each
    microbatch weighted by its share of the mask), so the pipeline's value is the whole
    batch's, with no MicrobatchReductionWarning; as an eval step and as a train step. (The
    loss at the full batch size is cut into the same sub-scans as the microbatch's, so the
    two graphs align node for node.)"""
    L, d = 8, 32
    k = jax.random.split(jax.random.key(0), 2)
    params = {"w": jax.random.normal(k[0], (L, d, d)) / 6, "b": jnp.zeros((L, d))}
    batch = {"x": jax.random.normal(k[1], (32, d)),
             "m": (jnp.arange(32) % 3 != 0).astype(jnp.float32)}      # uneven per microbatch
    table = np.linspace(0.0, 1.0, d, dtype=np.float32)

    def loss_and_h(params, batch):
        h, _ = jax.lax.scan(lambda h, p: (jax.nn.gelu(h @ p["w"] + p["b"]), None),
                            batch["x"], params)
        per = jnp.sum((h * table) ** 2, -1)
        return jnp.sum(per * batch["m"]) / jnp.maximum(jnp.sum(batch["m"]), 1.0), h

    def train_step(params, batch):
        (loss, _), grads = autopar.value_and_grad(loss_and_h, has_aux=True)(params, batch)
        return loss, grads
    step = train_step if train else loss_and_h
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.MicrobatchReductionWarning)
        par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(4, 4))
        got = par(params, batch)
    _assert_close(jax.jit(step)(params, batch), got)
    assert par.get_plan(params, batch).pipeline["microbatch_combine"][0] == "ratio"


def test_autopar_plan_plans_an_eval_step_for_a_cluster_this_machine_lacks():
    """Alpa served OPT-175B through pipelined forwards: `autopar.plan` plans an eval step of
    a GPT whose parameters (fp32, ~1.2 GiB) exceed a V100-preset device's budget for a
    16-GPU cluster from abstract values; the stage search spreads it over stages that fit."""
    cfg = GPTConfig(vocab_size=50304, seq_len=512, num_layers=8, hidden=2048, num_heads=16)
    net = GPT(cfg)
    tokens = jax.ShapeDtypeStruct((32, cfg.seq_len), jnp.int32)
    params = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.zeros((1, cfg.seq_len),
                                                                          jnp.int32)))

    def eval_step(params, tokens):
        logits = net.apply(params, tokens)
        return gpt_loss(logits, tokens)
    param_bytes = sum(np.prod(x.shape) * x.dtype.itemsize
                      for x in jax.tree_util.tree_leaves(params))
    budget = int(param_bytes / 6)      # no 4-GPU submesh holds the parameters
    cluster = autopar.ClusterSpec.preset("v100-p3.16xlarge", num_hosts=2)
    plan = autopar.plan(eval_step, params, tokens, cluster=cluster, method=(
        autopar.PipeshardParallel(num_microbatches=8, memory_budget_bytes=budget,
                                  layer_option=autopar.AutoLayerOption(num_layers=8))))
    assert plan.pipeline["forward_only"] and plan.pipeline["schedule"] == "forward"
    assert len(plan.stages) >= 2
    assert all(s.peak_memory_bytes <= budget for s in plan.stages)
    assert sum(len(s.device_ids) for s in plan.stages) == 16


def test_results_that_are_constants_or_arguments_pass_around_the_pipeline():
    """An eval step that also returns a constant and one of its arguments: those come back as
    they are, the computed result from the pipeline; a step computing none of its results
    is refused by name (nothing to pipeline)."""
    params = {"w": jax.random.normal(jax.random.key(0), (8, 8))}
    batch = {"x": jax.random.normal(jax.random.key(1), (4, 8))}

    def eval_step(params, batch):
        return jnp.sum(jnp.tanh(batch["x"] @ params["w"]) ** 2), 1.0, params

    got = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=_method(2, 2, 2))(
        params, batch)
    want = jax.jit(eval_step)(params, batch)
    _assert_close(want[0], got[0])
    assert float(got[1]) == 1.0
    np.testing.assert_array_equal(got[2]["w"], params["w"])
    with pytest.raises(InvalidArgumentError, match=r"takes no gradient and computes none of "
                       r"its results.*Fix: compute the results in the step"):
        autopar.parallelize(lambda p, b: p, mesh=mesh_of((2, 4)),
                            method=_method(2, 2, 2))(params, batch)


@pytest.mark.parametrize("batch_argnums", [(1,), (-1,)])
def test_results_free_of_the_batch_keep_their_value_and_dtype(batch_argnums):
    """An eval step returning a step counter + 1, a count and a new PRNG key next to its
    loss: each is the same in every microbatch, so it comes back as microbatch 0's (not
    averaged: an int stays an int, a key a key), as jax.jit returns it; `batch_argnums`
    may count from the end."""
    params = {"w": jax.random.normal(jax.random.key(0), (8, 8))}
    batch = {"x": jax.random.normal(jax.random.key(1), (16, 8))}
    state = {"params": params, "step": jnp.int32(5), "key": jax.random.key(3)}

    def eval_step(state, batch):
        loss = jnp.mean(jnp.tanh(batch["x"] @ state["params"]["w"]) ** 2)
        return (loss, state["step"] + 1, jnp.sum(state["params"]["w"] > 0),
                jax.random.split(state["key"])[0])

    want = jax.jit(eval_step)(state, batch)
    got = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), batch_argnums=batch_argnums,
                              method=_method(2, 4, 2))(state, batch)
    _assert_close(want[0], got[0])
    for w, g in zip(want[1:3], got[1:3]):
        assert g.dtype == w.dtype and int(g) == int(w)
    assert jax.dtypes.issubdtype(got[3].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(got[3]), jax.random.key_data(want[3]))


def test_a_forward_stage_is_charged_one_call_per_microbatch():
    """A forward-only stage runs one executable per microbatch (its forward), not two: its
    latency counts one call's overhead on a cluster whose calls cost something."""
    eval_step, params, batch = _mlp_eval(hidden=32, batch_size=16)
    call = 1e-3
    par = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=_method(2, 4))
    par = par.with_cluster(dataclasses.replace(par.cluster, call_overhead_s=call))
    plan = par.get_plan(params, batch)
    for s in plan.stages:
        assert s.latency_s - s.compute_s - s.comm_s - s.reshard_s == pytest.approx(call)


@pytest.mark.parametrize("stage_option", ["uniform", "auto"])
def test_a_forward_stage_that_does_not_fit_names_what_it_holds(stage_option):
    """The memory error of a forward-only stage names its parameters and its forward, not an
    optimizer state or a gradient accumulator it does not have."""
    eval_step, params, batch = _mlp_eval(hidden=64, batch_size=16)
    method = _method(2, 4, memory_budget_bytes=2000)
    if stage_option == "auto":
        method = dataclasses.replace(method, stage_option=autopar.AutoStageOption())
    par = autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=method)
    with pytest.raises(InfeasiblePlanError) as err:
        par.get_plan(params, batch)
    text = str(err.value)
    assert "optimizer" not in text and "accumulator" not in text, text
    if stage_option == "uniform":
        assert "with its parameters and one microbatch's forward" in text, text


def test_the_stage_that_makes_the_logits_keeps_every_microbatch_s_share():
    """An eval step's results stay from each microbatch to the end, where they combine: with
    the microbatch unchanged (batch 16 in 4, batch 32 in 8: the same stage plans), the last
    stage's predicted peak grows by the 4 more microbatches' logits, predictions, loss and
    accuracy, and no other stage's does."""
    eval_step, state, batch = _gpt_eval()
    big = make_gpt_batch(jax.random.key(2), 32, CFG)
    plans = [autopar.parallelize(eval_step, mesh=mesh_of((2, 4)), method=_method(
        4, m)).get_plan(state, b) for m, b in ((4, batch), (8, big))]
    small, large = ([s.peak_memory_bytes for s in p.stages] for p in plans)
    assert small[:-1] == large[:-1]
    per_microbatch = 4 * CFG.seq_len * (CFG.vocab_size * 4 + 4)     # logits f32, preds int32
    devices = len(plans[0].stages[-1].device_ids)
    grown = large[-1] - small[-1]
    assert 4 * per_microbatch / devices <= grown <= 4 * (per_microbatch + 8), (grown, devices)
