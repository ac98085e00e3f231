"""A small language model shaped like Flax's lm1b example, in ``flax.linen``.

What matters for autopar is how the example *trains*, not its size: a fixed sinusoidal
position table built with numpy and closed over (a jaxpr constant), dropout drawing from an
rng, token batches padded with 0 to uneven lengths, and the padding-weighted loss
``sum(ce * weights) / sum(weights)`` with ``weights = jnp.where(targets > 0, 1, 0)``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Lm1bConfig:
    vocab_size: int = 64
    seq_len: int = 16
    hidden: int = 32
    num_layers: int = 2
    num_heads: int = 4
    dropout_rate: float = 0.1


def sinusoid_table(length: int, hidden: int) -> np.ndarray:
    """lm1b's fixed position table: a numpy array the model closes over (a jaxpr constant)."""
    pos = np.arange(length)[:, None]
    i = np.arange(hidden)[None, :]
    angle = pos / 10000 ** ((2 * (i // 2)) / hidden)
    return np.where(i % 2 == 0, np.sin(angle), np.cos(angle)).astype(np.float32)


class Lm1bBlock(nn.Module):
    config: Lm1bConfig

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        cfg = self.config
        drop = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.SelfAttention(num_heads=cfg.num_heads, qkv_features=cfg.hidden, use_bias=False,
                             deterministic=True)(nn.LayerNorm()(x), mask=mask)
        x = x + drop(y)
        y = nn.Dense(cfg.hidden)(nn.relu(nn.Dense(4 * cfg.hidden)(nn.LayerNorm()(x))))
        return x + drop(y)


class Lm1bTransformer(nn.Module):
    """Shared input/output embedding, sinusoidal positions (numpy), `num_layers` blocks; call
    with `deterministic=False` and `rngs={"dropout": key}` to train with dropout."""
    config: Lm1bConfig = Lm1bConfig()

    @nn.compact
    def __call__(self, tokens, deterministic: bool = True):
        cfg = self.config
        embed = nn.Embed(cfg.vocab_size, cfg.hidden)
        x = embed(tokens) + sinusoid_table(cfg.seq_len, cfg.hidden)[None]
        x = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(x)
        for _ in range(cfg.num_layers):
            x = Lm1bBlock(cfg)(x, deterministic)
        return embed.attend(nn.LayerNorm()(x))


def make_lm1b_batch(key, batch_size: int, config: Lm1bConfig, lengths) -> dict:
    """{"inputs", "targets"} of shape [batch, seq_len]: random tokens in [1, vocab), example i
    padded with 0 after `lengths[i]` tokens; targets are the inputs shifted left by one."""
    tokens = jax.random.randint(key, (batch_size, config.seq_len), 1, config.vocab_size)
    keep = jnp.arange(config.seq_len)[None] < jnp.asarray(lengths)[:, None]
    tokens = jnp.where(keep, tokens, 0)
    return {"inputs": tokens, "targets": jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))}


def weighted_cross_entropy(logits, targets, weights):
    """lm1b's `compute_weighted_cross_entropy`: (sum of weighted token losses, sum of
    weights)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * weights), jnp.sum(weights)
