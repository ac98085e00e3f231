"""A small BERT written the way the Flax docs write models (linen, post-LayerNorm encoder layers,
a masked-LM head tied to the token embedding, a loss padded with per-token weights), with a
TrainState step: the BERT layer and BERT MLM cases of the method tests
(`tests/intra_op/test_constraints.py`) and of the "method promises" benchmark
(`benchmarks/methods.py`).

Example:
    >>> model = BertMLM(vocab=128, seq=16, hidden=64, heads=4, layers=2)
    >>> batch = bert_batch(16, 16, 128)
    >>> state, loss = bert_step(bert_state(model, batch), batch)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state


class BertLayer(nn.Module):
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x, mask):
        attn = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.hidden)
        h = nn.LayerNorm()(x + attn(x, x, mask=mask))
        y = nn.Dense(4 * self.hidden)(h)
        y = nn.Dense(self.hidden)(nn.gelu(y))
        return nn.LayerNorm()(h + y)


class BertMLM(nn.Module):
    vocab: int
    seq: int
    hidden: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, tokens, attention_mask):
        embed = nn.Embed(self.vocab, self.hidden)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.hidden))
        x = nn.LayerNorm()(embed(tokens) + pos[None])
        mask = nn.make_attention_mask(attention_mask, attention_mask)
        for i in range(self.layers):
            x = BertLayer(self.hidden, self.heads, name=f"layer_{i}")(x, mask)
        x = nn.LayerNorm()(nn.gelu(nn.Dense(self.hidden)(x)))
        bias = self.param("mlm_bias", nn.initializers.zeros, (self.vocab,))
        return embed.attend(x) + bias


def mlm_loss(logits, labels, weights):
    """Cross-entropy over the masked positions only (weights 0 on the padding)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def bert_batch(batch_size: int, seq: int, vocab: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (batch_size, seq)).astype(np.int32)
    lengths = rng.integers(seq // 2, seq + 1, batch_size)
    attention = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
    weights = (rng.random((batch_size, seq)) < 0.3) * attention
    return {"tokens": tokens * attention, "attention": attention,
            "labels": rng.integers(1, vocab, (batch_size, seq)).astype(np.int32),
            "weights": weights.astype(np.float32)}


def bert_state(model: nn.Module, batch: dict, tx=None):
    params = model.init(jax.random.key(0), batch["tokens"], batch["attention"])
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=tx or optax.adam(1e-3))


def bert_step(state, batch):
    def loss_fn(p):
        logits = state.apply_fn(p, batch["tokens"], batch["attention"])
        return mlm_loss(logits, batch["labels"], batch["weights"])
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


class LayerOnly(nn.Module):
    """One BERT encoder layer over given activations (the 'BERT layer' case), MSE loss."""
    hidden: int
    heads: int

    @nn.compact
    def __call__(self, x, attention):
        return BertLayer(self.hidden, self.heads)(x, nn.make_attention_mask(attention, attention))


def layer_batch(batch_size: int, seq: int, hidden: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    attention = (np.arange(seq)[None] < rng.integers(seq // 2, seq + 1, batch_size)[:, None])
    return {"x": rng.normal(size=(batch_size, seq, hidden)).astype(np.float32),
            "attention": attention.astype(np.int32),
            "y": rng.normal(size=(batch_size, seq, hidden)).astype(np.float32)}


def layer_step(state, batch):
    def loss_fn(p):
        out = state.apply_fn(p, batch["x"], batch["attention"])
        return jnp.mean((out - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
