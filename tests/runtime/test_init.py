"""Creating the train state in a step's plan layout (`step.init`, `autopar.init_sharded`): a GPT
state larger than one device's budget is created sharded, each device computing only its shards
(checked on the placed arrays and on XLA's memory analysis of the init executable); at a small
size the values are bit-identical to an unsharded `create_state()` and training equals plain
`jax.jit` on one device, on a 2x4 ShardParallel plan and on a 2-stage pipeline; the first call
re-uses the plan made for the abstract state; a state that differs from what the step expects
is named leaf by leaf."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import autopar
from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch, megatron_rules
from autopar.runtime.init import abstract_state, compile_init
from support.steps import (
    TINY_GPT,
    assert_equivalent,
    mesh_of,
    run_steps,
    sgd_momentum_clip,
    two_stages_2x2,
)

KEY = jax.random.key(0)


def gpt_case(cfg: GPTConfig, tx, *, value_and_grad=jax.value_and_grad, batch_size=16):
    """(create_state(key) -> TrainState, step(state, batch) -> (state, loss, grads), batches)."""
    model = GPT(cfg)

    def create_state(key):
        params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(p):
            return gpt_loss(state.apply_fn(p, batch["tokens"]), batch["tokens"])
        loss, grads = value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, grads

    batches = [make_gpt_batch(jax.random.fold_in(KEY, 1 + i), batch_size, cfg) for i in range(3)]
    return create_state, train_step, batches


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def _assert_layout(state, shardings):
    leaves, want = jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(shardings)
    assert len(leaves) == len(want)
    for x, s in zip(leaves, want):
        assert x.sharding == s, (x.sharding, s)


def _assert_bit_identical(got, create_state):
    """`got` equals `create_state(KEY)` compiled for one device bit for bit, and the eager
    `create_state(KEY)` to 2 ulp (XLA fuses the normal initializers' arithmetic under `jit`:
    eager and jitted differ by 1 ulp on one device already)."""
    one = jax.jit(create_state)(KEY)
    eager = create_state(KEY)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(one)
    for x, y, z in zip(*map(jax.tree_util.tree_leaves, (got, one, eager))):
        assert x.dtype == y.dtype and x.shape == y.shape and not x.weak_type
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        if jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_array_max_ulp(np.asarray(x), np.asarray(z), maxulp=2)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(z))


@pytest.mark.parametrize("method", [      # ZeRO-3 splits everything; ShardParallel: make test-slow
    autopar.Zero3Parallel, pytest.param(autopar.ShardParallel, marks=pytest.mark.slow)])
def test_state_larger_than_the_budget_is_created_sharded(method):
    cfg = GPTConfig(vocab_size=512, seq_len=32, num_layers=2, hidden=128, num_heads=4)
    create_state, train_step, batches = gpt_case(cfg, optax.adam(1e-3), batch_size=8)
    total = _nbytes(jax.eval_shape(create_state, KEY))            # params + 2 Adam moments
    # 5.8 MB of 6.4 MB: below the state, above what XLA compiles the step to (Zero3 5.3 MB
    # on XLA:CPU, whose gradients wait whole for one combined all-reduce: the memory model
    # counts them, intra_op/memory.collective_buffers; the planner's compiled check,
    # memory_check, refuses a budget of half the state).
    budget = int(0.9 * total)
    step = autopar.parallelize(train_step, mesh=mesh_of((2, 4)), donate_argnums=(0,),
                               method=method(memory_budget_bytes=budget))
    init = compile_init(create_state, step, batches[0], create_args=(KEY,))
    assert len(init.parts) == 1
    # XLA's own account of the init executable: no device holds anything like the state.
    mem = init.parts[0].compiled.memory_analysis()
    assert mem.output_size_in_bytes + mem.temp_size_in_bytes < budget
    assert init.memory_bytes_per_device < budget

    state = init.run(KEY)
    _assert_layout(state, step.input_shardings(state, batches[0])[0])
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(state))
    assert per_device < budget < total
    if method is autopar.Zero3Parallel:          # every parameter and moment split 8 ways
        assert per_device <= total / 4 and init.memory_bytes_per_device < total / 4
    plan = step.get_plan(state, batches[0])
    assert plan.peak_memory_bytes <= budget
    state, loss, _ = step(state, batches[0])
    assert np.isfinite(float(loss)) and len(step._cache) == 1      # the init's plan was used


@pytest.fixture(scope="module")
def megatron():
    """A tiny GPT on a 2x4 ShardParallel plan with Megatron's split pinned (so leaves really
    are split): the state created by `step.init`, and plain `jax.jit` training as reference."""
    create_state, train_step, batches = gpt_case(TINY_GPT, sgd_momentum_clip())
    step = autopar.parallelize(train_step, mesh=mesh_of((2, 4)), donate_argnums=(0,),
                               method=autopar.ShardParallel(sharding_rules=megatron_rules()))
    planned = []
    state = step.init(create_state, batches[0], create_args=(KEY,))
    planned.append(len(step._cache))
    plan = step.get_plan(state, batches[0])
    return SimpleNamespace(create_state=create_state, train_step=train_step, batches=batches,
                           step=step, state=state, plan=plan, planned=planned)


def test_shard_parallel_init_is_the_unsharded_state_in_the_plan_layout(megatron):
    state = megatron.state
    _assert_bit_identical(state, megatron.create_state)
    _assert_layout(state, megatron.step.input_shardings(state, megatron.batches[0])[0])
    assert any(not x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(state))


def test_shard_parallel_init_trains_like_jit_without_replanning(megatron):
    ref = run_steps(jax.jit(megatron.train_step), jax.jit(megatron.create_state)(KEY),
                    megatron.batches)
    step = megatron.step
    got = run_steps(step, megatron.state, megatron.batches)
    assert_equivalent(ref, got, compare_params=True, smooth=True)
    assert megatron.planned == [1] and len(step._cache) == 1
    assert step.get_plan(got[0], megatron.batches[0]) is megatron.plan


def test_pipeline_init_creates_each_stage_leaf_on_its_submesh():
    create_state, train_step, batches = gpt_case(TINY_GPT, sgd_momentum_clip(),
                                                 value_and_grad=autopar.value_and_grad)
    method = two_stages_2x2(sharding_rules=megatron_rules())
    step = autopar.parallelize(train_step, mesh=mesh_of((2, 4)), method=method)
    init = compile_init(create_state, step, batches[0], create_args=(KEY,))
    meshes = [p.mesh for p in init.parts]
    assert len(meshes) == 2 and not set(meshes[0].devices.flat) & set(meshes[1].devices.flat)
    assert sorted(i for p in init.parts for i in p.leaves) == list(
        range(init.state_tree.num_leaves))
    state = autopar.init_sharded(create_state, step, batches[0], create_args=(KEY,))
    _assert_layout(state, step.input_shardings(state, batches[0])[0])
    _assert_bit_identical(state, create_state)
    ref = run_steps(jax.jit(train_step), jax.jit(create_state)(KEY), batches)
    got = run_steps(step, state, batches)
    assert_equivalent(ref, got, compare_params=True, rtol=2e-5, smooth=True)
    assert len(step._cache) == 1


@pytest.mark.slow      # the parts machinery of a pipeline's init: the test above (make test)
def test_gradient_accumulation_init():
    """num_microbatches > 1 runs on the pipeline machinery (one stage on the whole mesh)."""
    create_state, train_step, batches = gpt_case(TINY_GPT, sgd_momentum_clip(),
                                                 value_and_grad=autopar.value_and_grad)
    method = autopar.ShardParallel(num_microbatches=2, sharding_rules=megatron_rules())
    step = autopar.parallelize(train_step, mesh=mesh_of((2, 4)), method=method)
    state = step.init(create_state, batches[0], create_args=(KEY,))
    _assert_layout(state, step.input_shardings(state, batches[0])[0])
    _assert_bit_identical(state, create_state)
    ref = run_steps(jax.jit(train_step), jax.jit(create_state)(KEY), batches)
    assert_equivalent(ref, run_steps(step, state, batches), compare_params=True, rtol=2e-5,
                      smooth=True)
    assert len(step._cache) == 1


def test_state_argnum_abstract_example_args_and_no_create_args():
    create_state, train_step, batches = gpt_case(TINY_GPT, optax.sgd(0.1))
    swapped = lambda batch, state: train_step(state, batch)
    step = autopar.parallelize(swapped, mesh=mesh_of((2, 4)), batch_argnums=(0,))
    spec = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batches[0])
    state = step.init(lambda: create_state(KEY), spec, state_argnum=1)
    _assert_bit_identical(state, create_state)
    _assert_layout(state, step.input_shardings(batches[0], state)[1])
    state, loss, _ = step(batches[0], state)
    assert np.isfinite(float(loss)) and len(step._cache) == 1


def test_a_state_unlike_the_planned_one_names_the_first_differing_leaf(megatron):
    wider = GPTConfig(vocab_size=128, seq_len=16, num_layers=2, hidden=64, num_heads=4)
    create_wider = gpt_case(wider, sgd_momentum_clip())[0]
    # The plan the step already made for this batch expects hidden=32.
    with pytest.raises(autopar.InvalidArgumentError,
                       match=r"first differing leaf `state\.params\['params'\]\['block_0'\]"
                             r"\['attn'\]\['out'\]\['bias'\]`.*float32\[64\].*float32\[32\]"):
        megatron.step.init(create_wider, megatron.batches[0], create_args=(KEY,))
    # A saved plan: the same, before anything is planned or traced.
    saved = autopar.parallelize(megatron.train_step, mesh=mesh_of((2, 4)), plan=megatron.plan)
    with pytest.raises(autopar.InvalidArgumentError, match="saved plan"):
        saved.init(create_wider, megatron.batches[0], create_args=(KEY,))
    assert not saved._cache
    # A different tree: the params alone instead of the TrainState.
    params_only = lambda key: megatron.create_state(key).params
    with pytest.raises(autopar.InvalidArgumentError, match=r"first differing leaf `state"):
        saved.init(params_only, megatron.batches[0], create_args=(KEY,))


def test_bad_arguments_are_named():
    create_state, train_step, batches = gpt_case(TINY_GPT, optax.sgd(0.1))
    step = autopar.parallelize(train_step, mesh=mesh_of((2, 4)))
    with pytest.raises(autopar.InvalidArgumentError, match="state_argnum=2"):
        step.init(create_state, batches[0], state_argnum=2, create_args=(KEY,))
    with pytest.raises(autopar.InvalidArgumentError, match="batch_argnums"):
        step.init(create_state, batches[0], state_argnum=1, create_args=(KEY,))
    with pytest.raises(autopar.InvalidArgumentError, match="(?s)create_args=.* must be a tuple"):
        step.init(create_state, batches[0], create_args=KEY)
    with pytest.raises(autopar.InvalidArgumentError, match="not a parallelized step"):
        autopar.init_sharded(create_state, train_step, batches[0], create_args=(KEY,))
    assert not step._cache


def test_abstract_state_is_strongly_typed():
    create_state = gpt_case(TINY_GPT, optax.sgd(0.1))[0]
    state = abstract_state(create_state, (KEY,))
    assert state.step.dtype == jnp.int32 and not state.step.weak_type
    assert jax.eval_shape(create_state, KEY).step.weak_type      # what is made strong


def test_create_args_of_every_kind_reach_create_state():
    """A typed key, raw key data, a Python int and a numpy array, each replicated; the values
    equal `jax.jit(create)` on one device and the init re-runs with new arguments."""
    def create(key, raw, n, arr):
        noise = jax.random.normal(jax.random.wrap_key_data(raw), (64, 32))
        return {"w": jax.random.normal(key, (64, 32)) + noise * n, "b": jnp.asarray(arr) * n}

    def step(p, x):
        return jax.tree_util.tree_map(lambda a: a * 0.9, p), jnp.sum(jnp.tanh(x @ p["w"]) + p["b"])

    par = autopar.parallelize(step, mesh=mesh_of((2, 4)))
    x = jnp.ones((8, 64))
    args = (KEY, jax.random.key_data(jax.random.key(4)), 2, np.arange(32, dtype=np.float32))
    init = compile_init(create, par, x, create_args=args)
    for a in (args, (jax.random.key(5), *args[1:])):
        state, want = init.run(*a), jax.jit(create)(*a)
        _assert_layout(state, par.input_shardings(state, x)[0])
        for k in want:
            np.testing.assert_array_equal(np.asarray(state[k]), np.asarray(want[k]))
    with pytest.raises(autopar.InvalidArgumentError, match="create_args have the structure"):
        init.run(KEY)
