"""`autopar.value_and_grad` on NNX modules (autopar/frontend/nnx_grad.py): what
`nnx.value_and_grad` computes, marked, so NNX steps run with gradient accumulation and
PipeshardParallel and match `nnx.jit` on one device (3 steps, fp32: to 1e-5 where the model
is smooth, by the routing rule of tests/support/equivalence.py for the ReLU CNN)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autopar
from support.nnx_models import (
    BnDropNet,
    assert_same_metrics,
    assert_same_state,
    microbatch_methods,
    mnist_batches,
    mnist_loss,
    mnist_objects,
    mnist_train_step,
    mse,
    mse_step,
    regression_batches,
)


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 32, rngs=rngs),
                                nnx.Linear(32, 4, rngs=rngs)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


def marked_step(model, optimizer, batch):
    loss, grads = autopar.value_and_grad(mse)(model, batch)
    optimizer.update(model, grads)
    return loss


def mlp_objects():
    model = Mlp(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def test_same_as_nnx_value_and_grad_outside_autopar():
    batch = regression_batches(1)[0]
    ref, got = BnDropNet(nnx.Rngs(0, dropout=1)), BnDropNet(nnx.Rngs(0, dropout=1))
    for m in (ref, got):
        m.drop.deterministic = True
    loss_fn = lambda m: mse(m, batch)
    l_ref, g_ref = nnx.jit(nnx.value_and_grad(loss_fn))(ref)
    l_got, g_got = nnx.jit(autopar.value_and_grad(loss_fn))(got)
    np.testing.assert_allclose(l_got, l_ref, rtol=1e-6)
    assert jax.tree_util.tree_structure(g_got) == jax.tree_util.tree_structure(g_ref)
    for a, b in zip(jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g_got)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert not np.allclose(got.bn.mean[...], 0.0)         # BatchNorm statistics written back
    assert_same_state(ref, got, steps=1)


@microbatch_methods(4)
def test_microbatched_nnx_step_matches_nnx_jit(method):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    ref, par = mlp_objects(), mlp_objects()
    step = autopar.parallelize(marked_step, mesh=mesh, batch_argnums=(2,), method=method)
    for batch in regression_batches(3, batch_size=32):
        np.testing.assert_allclose(step(*par, batch), nnx.jit(mse_step)(*ref, batch),
                                   rtol=1e-5)
    assert int(par[1].step[...]) == 3
    assert_same_state(ref[0], par[0], steps=3, smooth=True)       # tanh: smooth
    assert_same_state(ref[1], par[1], steps=3, smooth=True)


def test_nnx_value_and_grad_under_microbatches_names_the_fix():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    step = autopar.parallelize(mse_step, mesh=mesh, batch_argnums=(2,),
                               method=autopar.ShardParallel(num_microbatches=2))
    with pytest.raises(autopar.InvalidArgumentError,
                       match=r"nnx.value_and_grad do not count.*autopar.value_and_grad\(loss_fn\)"
                             r"\(model, batch\)"):
        step(*mlp_objects(), regression_batches(1)[0])


def test_rng_counter_changed_inside_the_marked_loss_raises():
    model = BnDropNet(nnx.Rngs(0, dropout=1))                # Dropout advances its counter
    with pytest.raises(autopar.UnsupportedError,
                       match=r"non-floating NNX state `drop.rngs.count` of argument 0"):
        autopar.value_and_grad(lambda m: mse(m, regression_batches(1)[0]))(model)


def test_batch_shaped_aux_under_microbatches_comes_back_full_batch():
    """Per-example predictions returned as aux under 4 microbatches come back for the whole
    batch, in its order, equal to nnx.jit's (see inter_op.reduction)."""
    def make(value_and_grad):
        def step_fn(model, optimizer, batch):
            def loss_fn(model):
                pred = model(batch["x"])
                return jnp.mean((pred - batch["y"]) ** 2), pred     # per-example predictions
            (loss, pred), grads = value_and_grad(loss_fn, has_aux=True)(model)
            optimizer.update(model, grads)
            return loss, pred
        return step_fn

    ref, par = mlp_objects(), mlp_objects()
    step = autopar.parallelize(make(autopar.value_and_grad), batch_argnums=(2,),
                               mesh=jax.make_mesh((2, 4), ("data", "model")),
                               method=autopar.ShardParallel(num_microbatches=4))
    for batch in regression_batches(2):
        got_loss, got_pred = step(*par, batch)
        want_loss, want_pred = nnx.jit(make(nnx.value_and_grad))(*ref, batch)
        assert got_pred.shape == want_pred.shape
        np.testing.assert_allclose(np.asarray(got_pred), np.asarray(want_pred), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_same_state(ref[0], par[0], steps=2, smooth=True)       # tanh: smooth


@microbatch_methods(2)
def test_mnist_tutorial_step_with_microbatches_matches_nnx_jit(method):
    """The MNIST tutorial step with its loss taken by autopar.value_and_grad: the metrics get
    the whole batch's logits back, so accuracy and loss equal nnx.jit's."""
    def step_fn(model, optimizer, metrics, batch):
        (loss, logits), grads = autopar.value_and_grad(mnist_loss, has_aux=True)(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    ref, par = mnist_objects(), mnist_objects()
    step = autopar.parallelize(step_fn, mesh=jax.make_mesh((2, 4), ("data", "model")),
                               batch_argnums=(3,), method=method)
    for batch in mnist_batches():
        nnx.jit(mnist_train_step)(*ref, batch)
        step(*par, batch)
    # A ReLU CNN after 3 steps: by the routing rule of tests/support/equivalence.py.
    assert_same_metrics(ref[2], par[2])
    for r, p in zip(ref, par):
        assert_same_state(r, p, steps=3, smooth=False)
