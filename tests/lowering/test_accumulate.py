"""Gradient accumulation as one executable (`lowering.accumulate`): the whole step of a
one-stage program in one jit, a loop over the microbatches inside it, equal to the per-task
executor it replaces and to `jax.jit` of the step."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from autopar.cost.hlo import collectives, loop_body_collectives, summary
from autopar.models.gpt import GPTConfig
from autopar.runtime.compile_only import abstract_args
from autopar.runtime.executor import Executor
from support.equivalence import assert_entrywise
from support.steps import make_case, mesh_of, sgd_momentum_clip

M = 4


def _flat(program, *args):
    leaves = jax.tree_util.tree_leaves(args)
    return [jax.device_put(x, s) for x, s in zip(leaves, program.in_shardings)]


@pytest.fixture(scope="module")
def gpt():
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(), batch_size=8,
                                     value_and_grad=autopar.value_and_grad)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=M),
                              donate_argnums=(0,))
    copy = lambda tree: jax.tree_util.tree_map(jnp.array, tree)
    program = par.get_compiled(copy(state), batches[0])
    return dict(step=step, state=state, batches=batches, par=par, program=program, copy=copy)


def test_the_step_is_one_executable_with_a_loop_over_the_microbatches(gpt):
    par, program, state, batch = gpt["par"], gpt["program"], gpt["state"], gpt["batches"][0]
    assert program.whole_step is not None and len(program.stages) == 1
    plan = par.get_plan(gpt["copy"](state), batch)
    assert plan.pipeline["one_executable"] is True
    assert "all in one executable (a loop over the microbatches)" in autopar.dump(plan)
    par(gpt["copy"](state), batch)
    stats = par.get_executor(gpt["copy"](state), batch).stats
    assert (stats.num_dispatches, stats.num_transfers) == (1, 0)
    compiled = program.whole_step.lower(*abstract_args(
        jax.tree_util.tree_leaves((state, batch)), program.in_shardings)).compile()
    hlo = compiled.as_text()
    assert hlo.count(" while(") == 1, "one loop: the microbatches"
    # the loop reduces only scalars (the loss); the gradients once, after it
    in_loop = summary(loop_body_collectives(hlo))
    assert in_loop.get("all-reduce", (0, 0))[1] <= 8 * in_loop.get("all-reduce", (0, 0))[0]
    assert summary(collectives(hlo))["all-reduce"][1] > 1e4
    # the donated state is updated in place
    assert compiled.memory_analysis().alias_size_in_bytes > 0


def test_equals_the_per_task_executor_and_jit_over_two_steps(gpt):
    par, program, step = gpt["par"], gpt["program"], gpt["step"]
    per_task = Executor(dataclasses.replace(program, whole_step=None))
    state = ref = want = gpt["state"]
    for batch in gpt["batches"][:2]:
        got = par(gpt["copy"](state), batch)
        old = jax.tree_util.tree_unflatten(par.get_graph(gpt["copy"](state), batch).out_tree,
                                           per_task.run(_flat(program, gpt["copy"](want), batch)))
        ref = jax.jit(step)(ref, batch)
        # the same sums in the same order as the per-task executor
        assert_entrywise(old, got, rtol=1e-6, what="one executable vs per task",
                         per_leaf_scale=True)
        assert_entrywise(ref, got, rtol=2e-5, what="vs jax.jit", per_leaf_scale=True)
        state, want, ref = got[0], old[0], ref[0]


def _ratio_step(params, batch):
    """A token-weighted loss sum(l * w) / sum(w) and per-example logits as an aux output."""
    def loss_fn(p):
        logits = jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return jnp.sum(per_token * batch["w"]) / jnp.sum(batch["w"]), logits
    (loss, logits), grads = autopar.value_and_grad(loss_fn, has_aux=True)(params)
    new = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)
    return new, loss, logits


def test_ratio_losses_and_per_example_outputs_merge_as_the_executor_does():
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(16, 32)) * 0.3, jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(32, 8)) * 0.3, jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(16, 16)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 8, 16)),
             "w": jnp.asarray(np.r_[np.zeros(4), rng.integers(0, 2, 12)], jnp.float32)}
    par = autopar.parallelize(_ratio_step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=M))
    got = par(params, batch)
    program = par.get_compiled(params, batch)
    assert program.whole_step is not None
    old = Executor(dataclasses.replace(program, whole_step=None)).run(
        _flat(program, params, batch))
    assert_entrywise(old, jax.tree_util.tree_leaves(got), rtol=1e-6, what="vs per task",
                     per_leaf_scale=True)
    assert_entrywise(jax.jit(_ratio_step)(params, batch), got, rtol=2e-5, what="vs jax.jit",
                     per_leaf_scale=True)


def test_the_plan_charges_one_call_per_step(gpt):
    """The whole step is one executable: the plan prices one call, not one per microbatch
    task and apply segment, and its pipeline latency is its predicted step."""
    call = 1e-3             # a cluster whose executable calls cost something
    par = gpt["par"].with_cluster(dataclasses.replace(gpt["par"].cluster, call_overhead_s=call))
    state, batch = gpt["state"], gpt["batches"][0]
    plan = par.get_plan(gpt["copy"](state), batch)
    assert plan.predicted_overhead_s == pytest.approx(call)
    assert plan.predicted_step_s == pytest.approx(plan.pipeline["predicted_latency_s"])
    per_task = M * plan.stages[0].latency_s          # what the DP summed: M tasks, 2 calls each
    assert plan.predicted_step_s == pytest.approx(per_task - 2 * M * call + call)


REMAT = "Involuntary full rematerialization"


def _whole_step_hlo_err(par, state, batch, capfd) -> str:
    program = par.get_compiled(state, batch)
    capfd.readouterr()
    program.whole_step.lower(*abstract_args(jax.tree_util.tree_leaves((state, batch)),
                                            program.in_shardings)).compile()
    return capfd.readouterr().err


def test_a_stage_moves_a_tensor_by_its_planned_steps_not_by_replicating_it(capfd, monkeypatch):
    """A stage's planned resharding that needs two collectives passes through its
    intermediate layout (as a one-mesh plan's does): this GPT at 4 examples per microbatch
    has one (a cotangent from [model, data, -] to the hidden split over both axes), which
    XLA:CPU makes by replicating the whole tensor when asked in one step."""
    from autopar.lowering import pipeline as lowering
    cfg = GPTConfig(vocab_size=2048, seq_len=128, num_layers=1, hidden=256, num_heads=4)
    step, state, batches = make_case("gpt", "linen", optax.sgd(0.1), batch_size=32,
                                     value_and_grad=autopar.value_and_grad, gpt_config=cfg)
    make = lambda: autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False,
                                       method=autopar.ShardParallel(num_microbatches=8))
    par = make()
    assert REMAT not in _whole_step_hlo_err(par, state, batches[0], capfd)
    assert_entrywise(jax.jit(step)(state, batches[0]), par(state, batches[0]), rtol=2e-5,
                     what="vs jax.jit", per_leaf_scale=True)
    # the case has such a move: with its steps dropped, XLA replicates
    monkeypatch.setattr(lowering, "reshard_paths", lambda *a: {})
    assert REMAT in _whole_step_hlo_err(make(), state, batches[0], capfd)
