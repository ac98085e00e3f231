"""A token-normalized loss whose denominator is any function of the batch alone is exact under
gradient accumulation (`inter_op.reduction`'s RATIO weighted by the whole batch's
denominator), with uneven padding that leaves one microbatch without a counted token; a
denominator that reads the parameters still warns."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from support.steps import mesh_of

B, T, V, H, M = 16, 8, 32, 16, 4


def _case():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, V, (B, T))
    lengths = rng.integers(1, T + 1, B)
    lengths[1::M] = 0           # microbatch 1 (examples 1, 5, 9, 13) is all padding
    pad = np.arange(T)[None] < lengths[:, None]
    batch = {"tokens": jnp.asarray(tokens * pad, jnp.int32),
             "weights": jnp.asarray(pad, jnp.float32)}
    params = {"embed": jnp.asarray(rng.normal(size=(V, H)) * 0.3, jnp.float32),
              "out": jnp.asarray(rng.normal(size=(H, V)) * 0.3, jnp.float32)}
    return params, batch


def _token_loss(p, batch):
    logits = jnp.tanh(p["embed"][batch["tokens"]]) @ p["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"])


DENOMINATORS = {
    "clamped": lambda p, b: jnp.maximum(jnp.sum(b["weights"]), 1.0),
    "epsilon": lambda p, b: jnp.sum(b["weights"]) + 1e-8,
    "where count": lambda p, b: jnp.where(b["tokens"] > 0, 1.0, 0.0).sum(),
}


def _step(den):
    def step(params, batch):
        def loss_fn(p):
            w = jnp.where(batch["tokens"] > 0, 1.0, 0.0) if den == "where count" \
                else batch["weights"]
            return jnp.sum(_token_loss(p, batch) * w) / DENOMINATORS[den](p, batch)
        loss, grads = autopar.value_and_grad(loss_fn)(params)
        return loss, grads
    return step


@pytest.mark.parametrize("den", sorted(DENOMINATORS))
def test_batch_only_denominators_are_exact(den):
    params, batch = _case()
    par = autopar.parallelize(_step(den), mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=M))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.MicrobatchReductionWarning)
        got = par(params, batch)
    assert par.get_plan(params, batch).pipeline["microbatch_combine"][0] == "ratio"
    want = jax.jit(_step(den))(params, batch)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.abs(w).max()))


def test_a_denominator_that_reads_the_parameters_warns():
    params, batch = _case()

    def step(params, batch):
        def loss_fn(p):
            per = _token_loss(p, batch) * batch["weights"]
            return jnp.sum(per) / jnp.maximum(jnp.sum(batch["weights"] * p["out"][0, 0]), 1.0)
        return autopar.value_and_grad(loss_fn)(params)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=M))
    with pytest.warns(autopar.MicrobatchReductionWarning, match="the loss"):
        par(params, batch)
