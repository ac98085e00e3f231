"""Tests for models/ (linen and NNX MLP and GPT)."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

from autopar.frontend.markers import STAGE_BOUNDARY
from autopar.models import (
    GPT,
    MLP,
    GPTConfig,
    NnxGPT,
    NnxMLP,
    gpt_flops_per_token,
    gpt_loss,
    gpt_param_count,
    make_gpt_batch,
    make_mlp_batch,
    mse_loss,
)
from support.steps import num_params

# Tiny shapes, shared by all tests so that JAX's per-shape compilations are
# reused (compile time dominates on CPU).
TINY = GPTConfig(vocab_size=64, seq_len=8, num_layers=2, hidden=16, num_heads=2, mlp_ratio=4)
IN, HID, OUT, BATCH = 5, 8, 3, 8


# A linen GPT ``init`` costs seconds on CPU (eager: hundreds of tiny ops; under
# jit: a slow compile of the RNG). The tests therefore check linen ``init``
# with ``jax.eval_shape`` and take the parameter *values* from an NNX model,
# whose parameter tree has exactly the linen structure (checked below).


@pytest.fixture(scope="module")
def tiny_gpt():
    """(linen model, linen-structured params, batch of 4) for the TINY config."""
    batch = make_gpt_batch(jax.random.key(0), 4, TINY)
    params = nnx.to_pure_dict(nnx.state(NnxGPT(TINY, rngs=nnx.Rngs(1))))
    return GPT(TINY), params, batch


@functools.cache
def _jit_apply(model):
    return jax.jit(model.apply)


def _apply_linen(model, params, x):
    return _jit_apply(model)({"params": params}, x)


@nnx.jit
def _apply_nnx(model, x):
    return model(x)


def _linen_param_shapes(config):
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    return jax.eval_shape(GPT(config).init, jax.random.key(0), tokens)["params"]


def _load_linen_params_into_nnx(model: nnx.Module, linen_params, rename=lambda tree: tree):
    """Returns ``model`` with its parameters replaced by ``rename(linen_params)``."""
    graphdef, state = nnx.split(model)
    new = jax.tree.map(jnp.asarray, rename(dict(linen_params)))
    old_shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(state))
    assert jax.tree.map(jnp.shape, new) == old_shapes
    nnx.replace_by_pure_dict(state, new)
    return nnx.merge(graphdef, state)


def _mlp_linen_to_nnx_names(params):
    return {"layers": {i: params[f"Dense_{i}"] for i in range(len(params))}}


# -- shapes and parameter counts ---------------------------------------------


@pytest.mark.parametrize("out_dim", [None, OUT])
def test_mlp_shapes(out_dim):
    batch = make_mlp_batch(jax.random.key(0), BATCH, IN, OUT)
    assert batch["x"].shape == (BATCH, IN) and batch["x"].dtype == jnp.float32
    assert batch["y"].shape == (BATCH, OUT) and batch["y"].dtype == jnp.float32
    model = MLP(num_layers=3, hidden=HID, out_dim=out_dim)
    params = model.init(jax.random.key(1), batch["x"])["params"]
    assert sorted(params) == ["Dense_0", "Dense_1", "Dense_2"]
    want = (BATCH, out_dim or HID)
    assert _apply_linen(model, params, batch["x"]).shape == want
    nnx_model = NnxMLP(3, IN, HID, out_dim=out_dim, rngs=nnx.Rngs(0))
    assert _apply_nnx(nnx_model, batch["x"]).shape == want
    assert num_params(nnx.state(nnx_model)) == num_params(params)


def test_mlp_without_bias_and_bad_depth():
    model = MLP(num_layers=3, hidden=HID, out_dim=OUT, use_bias=False)
    params = model.init(jax.random.key(0), jnp.ones((BATCH, IN)))["params"]
    assert all(sorted(layer) == ["kernel"] for layer in params.values())
    nnx_model = NnxMLP(3, IN, HID, out_dim=OUT, use_bias=False, rngs=nnx.Rngs(0))
    assert num_params(nnx.state(nnx_model)) == num_params(params)
    with pytest.raises(ValueError, match="num_layers"):
        NnxMLP(0, IN, HID, rngs=nnx.Rngs(0))


def test_gpt_shapes_and_param_count(tiny_gpt):
    model, params, batch = tiny_gpt
    logits = _apply_linen(model, params, batch["tokens"])
    assert batch["tokens"].shape == (4, TINY.seq_len) and batch["tokens"].dtype == jnp.int32
    assert logits.shape == (4, TINY.seq_len, TINY.vocab_size) and logits.dtype == jnp.float32
    linen_params = _linen_param_shapes(TINY)
    assert num_params(linen_params) == gpt_param_count(TINY)
    assert {f"block_{i}" for i in range(TINY.num_layers)} <= set(linen_params)
    assert jax.tree.map(jnp.shape, dict(linen_params)) == jax.tree.map(jnp.shape, params)

    nnx_model = NnxGPT(TINY, rngs=nnx.Rngs(0))
    nnx_logits = _apply_nnx(nnx_model, batch["tokens"])
    assert nnx_logits.shape == logits.shape and nnx_logits.dtype == jnp.float32
    assert num_params(nnx.state(nnx_model, nnx.Param)) == gpt_param_count(TINY)


def test_gpt_param_count_other_config():
    config = GPTConfig(vocab_size=50, seq_len=6, num_layers=3, hidden=24, num_heads=3, mlp_ratio=2)
    assert num_params(_linen_param_shapes(config)) == gpt_param_count(config)
    nnx_model = nnx.eval_shape(lambda: NnxGPT(config, rngs=nnx.Rngs(0)))
    assert num_params(nnx.state(nnx_model)) == gpt_param_count(config)


def test_gpt_shorter_sequence_and_errors(tiny_gpt):
    model, params, batch = tiny_gpt
    assert _apply_linen(model, params, batch["tokens"][:, :5]).shape == (4, 5, TINY.vocab_size)
    with pytest.raises(ValueError, match="seq_len"):
        _apply_linen(model, params, jnp.zeros((1, TINY.seq_len + 1), jnp.int32))
    with pytest.raises(ValueError, match="divisible by num_heads"):
        GPTConfig(hidden=10, num_heads=4)


def test_gpt_flops_per_token():
    c = TINY
    n = gpt_param_count(c) - c.vocab_size * c.hidden - c.seq_len * c.hidden
    assert gpt_flops_per_token(c) == 6 * n + 12 * c.num_layers * c.hidden * c.seq_len


# -- semantics -----------------------------------------------------------------


def test_gpt_is_causal(tiny_gpt):
    model, params, batch = tiny_gpt
    nnx_model = NnxGPT(TINY, rngs=nnx.Rngs(0))
    tokens = batch["tokens"]
    t = 5
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % TINY.vocab_size)
    for apply in (lambda x: _apply_linen(model, params, x), lambda x: _apply_nnx(nnx_model, x)):
        before, after = apply(tokens), apply(changed)
        np.testing.assert_array_equal(before[:, :t], after[:, :t])
        assert not np.allclose(before[:, t:], after[:, t:])


def test_gpt_linen_and_nnx_agree_with_same_weights(tiny_gpt):
    model, params, batch = tiny_gpt
    nnx_model = _load_linen_params_into_nnx(NnxGPT(TINY, rngs=nnx.Rngs(7)), params)
    np.testing.assert_allclose(
        _apply_nnx(nnx_model, batch["tokens"]),
        _apply_linen(model, params, batch["tokens"]),
        atol=1e-5, rtol=1e-5,
    )


def test_mlp_linen_and_nnx_agree_with_same_weights():
    batch = make_mlp_batch(jax.random.key(0), BATCH, IN, OUT)
    model = MLP(num_layers=3, hidden=HID, out_dim=OUT)
    params = model.init(jax.random.key(1), batch["x"])["params"]
    nnx_model = _load_linen_params_into_nnx(
        NnxMLP(3, IN, HID, out_dim=OUT, rngs=nnx.Rngs(2)), params, _mlp_linen_to_nnx_names
    )
    np.testing.assert_allclose(
        _apply_nnx(nnx_model, batch["x"]),
        _apply_linen(model, params, batch["x"]),
        atol=1e-5, rtol=1e-5,
    )


def test_gpt_loss():
    tokens = jnp.array([[1, 2, 3], [3, 2, 1]], jnp.int32)
    uniform = jnp.zeros((2, 3, 5), jnp.float32)
    np.testing.assert_allclose(gpt_loss(uniform, tokens), math.log(5), rtol=1e-6)
    # The last position's logits do not count.
    perfect = 100.0 * jax.nn.one_hot(jnp.roll(tokens, -1, axis=1), 5)
    np.testing.assert_allclose(gpt_loss(perfect, tokens), 0.0, atol=1e-6)
    np.testing.assert_allclose(mse_loss(jnp.ones((2, 2)), jnp.zeros((2, 2))), 1.0)


# -- training ------------------------------------------------------------------


def _train_linen(model, params, loss_of_output, batch, inputs, steps=5, lr=0.1):
    """The linen training step pattern (TrainState + value_and_grad)."""
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(lr)
    )

    @jax.jit
    def train_step(state, batch):
        def loss_fn(params):
            out = state.apply_fn({"params": params}, batch[inputs])
            return loss_of_output(out, batch)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(steps):
        state, loss = train_step(state, batch)
        losses.append(float(loss))
    return losses


def _train_nnx(model, loss_of_output, batch, inputs, steps=5, lr=0.1):
    """The NNX training step pattern (split into pytrees, merge inside)."""
    graphdef, params = nnx.split(model)
    tx = optax.sgd(lr)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
        def loss_fn(params):
            out = nnx.merge(graphdef, params)(batch[inputs])
            return loss_of_output(out, batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
    return losses


def _mlp_loss(out, batch):
    return mse_loss(out, batch["y"])


def _gpt_loss(out, batch):
    return gpt_loss(out, batch["tokens"])


def _assert_decreasing(losses):
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses


def test_mlp_training_reduces_loss_linen_and_nnx():
    batch = make_mlp_batch(jax.random.key(0), BATCH, IN, OUT)
    model = MLP(num_layers=3, hidden=HID, out_dim=OUT)
    params = model.init(jax.random.key(1), batch["x"])["params"]
    _assert_decreasing(_train_linen(model, params, _mlp_loss, batch, "x"))
    nnx_model = NnxMLP(3, IN, HID, out_dim=OUT, rngs=nnx.Rngs(0))
    _assert_decreasing(_train_nnx(nnx_model, _mlp_loss, batch, "x"))


def test_gpt_training_reduces_loss_linen_and_nnx(tiny_gpt):
    model, params, batch = tiny_gpt
    _assert_decreasing(_train_linen(model, params, _gpt_loss, batch, "tokens", lr=0.5))
    nnx_model = NnxGPT(TINY, rngs=nnx.Rngs(0))
    _assert_decreasing(_train_nnx(nnx_model, _gpt_loss, batch, "tokens", lr=0.5))


# -- dtype ---------------------------------------------------------------------


def test_bf16_compute_float32_params():
    config = dataclasses.replace(TINY, dtype=jnp.bfloat16)
    batch = make_gpt_batch(jax.random.key(0), 4, config)
    nnx_model = NnxGPT(config, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(nnx_model))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(
        lambda x: (x.shape, x.dtype), dict(_linen_param_shapes(config))
    )
    logits = _apply_linen(GPT(config), params, batch["tokens"])
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))

    nnx_logits = _apply_nnx(nnx_model, batch["tokens"])
    assert nnx_logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(nnx_logits)))

    x = jnp.ones((BATCH, IN))
    mlp = MLP(num_layers=3, hidden=HID, out_dim=OUT, dtype=jnp.bfloat16)
    mlp_params = mlp.init(jax.random.key(0), x)["params"]
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(mlp_params))
    assert _apply_linen(mlp, mlp_params, x).dtype == jnp.bfloat16
    nnx_mlp = NnxMLP(3, IN, HID, out_dim=OUT, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert _apply_nnx(nnx_mlp, x).dtype == jnp.bfloat16


# -- stage boundaries ----------------------------------------------------------


def test_gpt_stage_boundaries_change_nothing(tiny_gpt):
    """Marked linen and NNX GPTs give the unmarked linen loss and gradients."""
    _, params, batch = tiny_gpt
    tokens = batch["tokens"]
    marked = dataclasses.replace(TINY, stage_boundaries=True)
    graphdef, state = nnx.split(
        _load_linen_params_into_nnx(NnxGPT(marked, rngs=nnx.Rngs(0)), params))

    def linen_loss(config):
        return lambda p: gpt_loss(GPT(config).apply({"params": p}, tokens), tokens)

    def nnx_loss(state):
        return gpt_loss(nnx.merge(graphdef, state)(tokens), tokens)

    loss, grads = jax.jit(jax.value_and_grad(linen_loss(TINY)))(params)
    for loss_fn, p, tol in ((linen_loss(marked), params, 1e-6), (nnx_loss, state, 1e-5)):
        loss_m, grads_m = jax.jit(jax.value_and_grad(loss_fn))(p)
        if p is state:
            grads_m = nnx.to_pure_dict(grads_m)
        np.testing.assert_allclose(loss_m, loss, rtol=tol)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=10 * tol, atol=tol),
                     dict(grads_m), dict(grads))
        names = [e.primitive.name for e in jax.make_jaxpr(loss_fn)(p).jaxpr.eqns]
        assert names.count(STAGE_BOUNDARY) == TINY.num_layers - 1
    names = [e.primitive.name for e in jax.make_jaxpr(linen_loss(TINY))(params).jaxpr.eqns]
    assert STAGE_BOUNDARY not in names
