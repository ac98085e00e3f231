"""A small Gemma-like decoder in Flax NNX, written the way NNX users write one: RMSNorm,
rotary position embeddings (RoPE), grouped-query attention (fewer key/value heads than query
heads), a gated GELU MLP, blocks in an `nnx.List`, and logits tied to the token embedding.

Example:
    >>> cfg = GemmaConfig()
    >>> model = Gemma(cfg, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    >>> nnx_train_step(model, optimizer, make_gemma_batch(jax.random.key(1), 8, cfg))
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    vocab_size: int = 128
    seq_len: int = 16
    num_layers: int = 2
    hidden: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    mlp_hidden: int = 64
    rope_base: float = 10_000.0


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.zeros((dim,)))
        self.eps = eps

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + self.eps) * (1.0 + self.scale[...])


def rope(x, positions, base: float):
    """Rotary embedding of x [batch, seq, heads, head_dim] at `positions` [seq]."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]     # [seq, half]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, c: GemmaConfig, *, rngs: nnx.Rngs):
        self.c = c
        self.q = nnx.Linear(c.hidden, c.num_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(c.hidden, 2 * c.num_kv_heads * c.head_dim, use_bias=False,
                             rngs=rngs)
        self.out = nnx.Linear(c.num_heads * c.head_dim, c.hidden, use_bias=False, rngs=rngs)

    def __call__(self, x):
        c = self.c
        b, s, _ = x.shape
        pos = jnp.arange(s)
        q = rope(self.q(x).reshape(b, s, c.num_heads, c.head_dim), pos, c.rope_base)
        k, v = jnp.split(self.kv(x).reshape(b, s, 2 * c.num_kv_heads, c.head_dim), 2, axis=2)
        k = rope(k, pos, c.rope_base)
        group = c.num_heads // c.num_kv_heads          # query heads per key/value head
        q = q.reshape(b, s, c.num_kv_heads, group, c.head_dim)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(c.head_dim).astype(x.dtype)
        mask = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(mask, scores, -1e9)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, -1)
        return self.out(out)


class Block(nnx.Module):
    def __init__(self, c: GemmaConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(c.hidden)
        self.attn = Attention(c, rngs=rngs)
        self.mlp_norm = RMSNorm(c.hidden)
        self.gate = nnx.Linear(c.hidden, c.mlp_hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(c.hidden, c.mlp_hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(c.mlp_hidden, c.hidden, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.gelu(self.gate(h)) * self.up(h))


class Gemma(nnx.Module):
    def __init__(self, c: GemmaConfig, *, rngs: nnx.Rngs):
        self.c = c
        self.embed = nnx.Embed(c.vocab_size, c.hidden, rngs=rngs)
        self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
        self.final_norm = RMSNorm(c.hidden)

    def __call__(self, tokens):
        x = self.embed(tokens) * jnp.sqrt(self.c.hidden).astype(jnp.float32)
        for layer in self.layers:
            x = layer(x)
        return self.embed.attend(self.final_norm(x))      # logits tied to the embedding


def gemma_loss(model: Gemma, batch):
    """Next-token cross entropy."""
    logits = model(batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["tokens"][:, 1:]).mean()


def make_gemma_batch(key, batch_size: int, c: GemmaConfig):
    return {"tokens": jax.random.randint(key, (batch_size, c.seq_len + 1), 0, c.vocab_size)}


def nnx_train_step(model: Gemma, optimizer: nnx.Optimizer, batch):
    """The NNX training step: gradient, optimizer update in place, loss returned."""
    loss, grads = nnx.value_and_grad(gemma_loss)(model, batch)
    optimizer.update(model, grads)
    return loss
