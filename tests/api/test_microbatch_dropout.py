"""Dropout under gradient accumulation and pipelines equals the whole batch's step: each
microbatch draws its rows of the whole batch's masks (`inter_op.random_rows`,
`lowering.microbatch_bits`), whether the key is a typed `jax.random.key` or a raw `PRNGKey`,
and wherever it comes from (an argument, the state, per-example keys in the batch, a closure).
Folding the keys per microbatch (other masks) fails these comparisons by far more than their
tolerances (the GPT's accumulated loss then differs by 0.6%)."""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar
from support.steps import mesh_of

B, T, V, H = 8, 16, 64, 32
ACCUMULATE = autopar.ShardParallel(num_microbatches=4)
PIPELINE = autopar.PipeshardParallel(
    num_microbatches=4, layer_option=autopar.AutoLayerOption(num_layers=2),
    stage_option=autopar.UniformStageOption(num_stages=2))


class Block(nn.Module):
    """A GPT-2 block: attention and MLP, dropout on the attention weights and residuals."""
    causal: bool

    @nn.compact
    def __call__(self, x, mask, train):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=4, dropout_rate=0.1,
                                            deterministic=not train)(h, h, mask=mask)
        x = x + nn.Dropout(0.1, deterministic=not train)(h)
        h = nn.Dense(H)(nn.gelu(nn.Dense(4 * H)(nn.LayerNorm()(x))))
        return x + nn.Dropout(0.1, deterministic=not train)(h)


class LM(nn.Module):
    """GPT-2 style (causal) or BERT style (bidirectional, a padding mask) language model."""
    causal: bool

    @nn.compact
    def __call__(self, tokens, train, pad=None):
        embed = nn.Embed(V, H)
        x = embed(tokens) + self.param("pos", nn.initializers.normal(0.02), (T, H))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        mask = nn.make_causal_mask(tokens) if self.causal else nn.make_attention_mask(pad, pad)
        for _ in range(2):
            x = Block(self.causal)(x, mask, train)
        return embed.attend(nn.LayerNorm()(x))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    pad = (np.arange(T)[None] < rng.integers(T // 2, T + 1, B)[:, None]).astype(np.int32)
    return {"tokens": jnp.asarray(rng.integers(1, V, (B, T)) * pad, jnp.int32),
            "pad": jnp.asarray(pad), "weights": jnp.asarray((rng.random((B, T)) < 0.3) * pad,
                                                           jnp.float32)}


def _loss(model, params, batch, key):
    logits = model.apply(params, batch["tokens"], True, batch["pad"], rngs={"dropout": key})
    if model.causal:       # next-token mean cross-entropy
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                             batch["tokens"][:, 1:])
        return jnp.mean(ce)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"])
    return jnp.sum(ce * batch["weights"]) / jnp.sum(batch["weights"])     # masked tokens


def _model(causal):
    model = LM(causal)
    batch = _batch()
    params = model.init(jax.random.key(0), batch["tokens"], False, batch["pad"])
    return model, params, batch


def _run(step, args, method, batch_argnums=(1,)):
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method,
                              batch_argnums=batch_argnums)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.MicrobatchReductionWarning)   # nothing inexact
        got = par(*args)
    return got, jax.jit(step)(*args)


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)          # the loss
    want_grads = jax.tree_util.tree_leaves(want[1])
    scale = max(float(np.abs(w).max()) for w in want_grads)  # some leaves' are 0 (key biases)
    for g, w in zip(jax.tree_util.tree_leaves(got[1]), want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("method", [ACCUMULATE, PIPELINE], ids=["accumulate", "pipeline"])
@pytest.mark.parametrize("causal", [True, False], ids=["gpt", "bert"])
def test_dropout_equals_the_whole_batch_step(causal, method):
    """A typed key folded with the step, as the Flax examples write it."""
    model, params, batch = _model(causal)

    def step(params, batch, key, count):
        key = jax.random.fold_in(key, count)
        return autopar.value_and_grad(lambda p: _loss(model, p, batch, key))(params)
    _assert_same(*_run(step, (params, batch, jax.random.key(1), jnp.int32(3)), method))


@pytest.mark.parametrize("method", [ACCUMULATE, PIPELINE], ids=["accumulate", "pipeline"])
@pytest.mark.parametrize("where", ["raw argument", "state", "closure", "batch"])
def test_keys_from_anywhere(where, method):
    model, params, batch = _model(True)
    if where == "batch":      # a key per example (split with the batch): token dropout
        def step(params, batch):
            def loss_fn(p):
                logits = model.apply(p, batch["tokens"], False)
                keep = jax.vmap(lambda k: jax.random.bernoulli(k, 0.9, (T - 1,)))(
                    batch["keys"])
                ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                                     batch["tokens"][:, 1:])
                return jnp.mean(ce * keep / 0.9)
            return autopar.value_and_grad(loss_fn)(params)
        args = (params, {**batch, "keys": jax.random.split(jax.random.key(2), B)})
    elif where == "closure":
        key = jax.random.key(4)

        def step(params, batch):
            return autopar.value_and_grad(lambda p: _loss(model, p, batch, key))(params)
        args = (params, batch)
    elif where == "state":
        def step(state, batch):
            key = jax.random.fold_in(state["rng"], state["step"])
            return autopar.value_and_grad(lambda p: _loss(model, p, batch, key))(
                state["params"])
        args = ({"params": params, "rng": jax.random.key(5), "step": jnp.int32(2)}, batch)
    else:
        def step(params, batch, key):
            return autopar.value_and_grad(lambda p: _loss(model, p, batch, key))(params)
        args = (params, batch, jax.random.PRNGKey(6))
    _assert_same(*_run(step, args, method))
