"""A small GPT (decoder-only transformer) in ``flax.linen`` and Flax NNX.

The math is deliberately plain so that a whole training step traces to a
simple jaxpr: no dropout, no RNG at apply time, no fused attention kernels,
layers unrolled in Python. Both APIs build the same architecture with the same
parameter names, so ``nnx.to_pure_dict(nnx.state(NnxGPT(...)))`` has exactly
the tree structure of the linen ``params``::

    tok_embed/embedding                 [vocab, hidden]
    pos_embed                           [seq_len, hidden]
    block_{i}/ln_1/{scale,bias}         [hidden]
    block_{i}/attn/qkv/{kernel,bias}    [hidden, 3*hidden], [3*hidden]
    block_{i}/attn/out/{kernel,bias}    [hidden, hidden], [hidden]
    block_{i}/ln_2/{scale,bias}         [hidden]
    block_{i}/mlp/fc/{kernel,bias}      [hidden, mlp_ratio*hidden], [mlp_ratio*hidden]
    block_{i}/mlp/proj/{kernel,bias}    [mlp_ratio*hidden, hidden], [hidden]
    ln_f/{scale,bias}                   [hidden]
    lm_head/kernel                      [hidden, vocab]   (untied, no bias)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from autopar.frontend.markers import mark_stage_boundary

Dtype = Any

# Added to masked attention scores (scores are in float32 at that point).
_MASK_VALUE = -1e9
_POS_EMBED_INIT = jax.nn.initializers.normal(stddev=0.02)


def check_positive_ints(config: Any, names: tuple[str, ...]) -> None:
    """Raise ValueError naming the first of `config`'s fields `names` that is not an int >= 1
    (the model configs share this rule)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{type(config).__name__}.{name} must be a positive int, got {value!r}."
            )


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of :class:`GPT` / :class:`NnxGPT`.

    ``dtype`` is the compute dtype (activations, matmuls); ``param_dtype`` the
    storage dtype of the parameters. With ``stage_boundaries`` the activation
    between consecutive blocks is marked with :func:`autopar.mark_stage_boundary`
    (an identity: values and gradients are unchanged).
    """

    vocab_size: int = 1024
    seq_len: int = 64
    num_layers: int = 2
    hidden: int = 128
    num_heads: int = 4
    mlp_ratio: int = 4
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    stage_boundaries: bool = False
    scan_layers: bool = False      # linen GPT: blocks under `nn.scan` with stacked parameters

    def __post_init__(self):
        check_positive_ints(self, ("vocab_size", "seq_len", "num_layers", "hidden",
                                   "num_heads", "mlp_ratio"))
        if self.hidden % self.num_heads != 0:
            raise ValueError(
                f"GPTConfig.hidden ({self.hidden}) must be divisible by "
                f"num_heads ({self.num_heads}); pick num_heads among the "
                f"divisors of hidden or change hidden."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.hidden


# ---------------------------------------------------------------------------
# Shared math (used by both APIs so they cannot drift apart)
# ---------------------------------------------------------------------------


def _causal_attention(qkv: jax.Array, num_heads: int, dtype: Dtype) -> jax.Array:
    """Causal multi-head attention from a fused ``qkv`` [B, S, 3H] -> [B, S, H]."""
    b, s, three_h = qkv.shape
    h = three_h // 3
    d = h // num_heads
    q, k, v = jnp.split(qkv, 3, axis=-1)
    q = q.reshape(b, s, num_heads, d)
    k = k.reshape(b, s, num_heads, d)
    v = v.reshape(b, s, num_heads, d)
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / jnp.asarray(math.sqrt(d), dtype)
    scores = scores.astype(jnp.float32)
    mask = jnp.tril(jnp.ones((s, s), dtype=jnp.bool_))
    scores = jnp.where(mask[None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bnqk,bknd->bqnd", probs, v)
    return out.reshape(b, s, h)


def _check_tokens(tokens: jax.Array, config: GPTConfig) -> None:
    if tokens.ndim != 2:
        raise ValueError(
            f"GPT expects tokens of shape [batch, seq], got shape {tokens.shape}."
        )
    if tokens.shape[1] > config.seq_len:
        raise ValueError(
            f"GPT got a sequence of length {tokens.shape[1]} but "
            f"GPTConfig.seq_len is {config.seq_len}; raise seq_len or "
            f"shorten the input."
        )


# ---------------------------------------------------------------------------
# flax.linen
# ---------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
        qkv = nn.Dense(3 * c.hidden, name="qkv", **dense)(x)
        y = _causal_attention(qkv, c.num_heads, c.dtype)
        return nn.Dense(c.hidden, name="out", **dense)(y)


class MlpBlock(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
        x = nn.Dense(c.mlp_hidden, name="fc", **dense)(x)
        x = jax.nn.gelu(x, approximate=True)
        return nn.Dense(c.hidden, name="proj", **dense)(x)


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        ln = dict(dtype=c.dtype, param_dtype=c.param_dtype)
        x = x + CausalSelfAttention(c, name="attn")(nn.LayerNorm(name="ln_1", **ln)(x))
        x = x + MlpBlock(c, name="mlp")(nn.LayerNorm(name="ln_2", **ln)(x))
        return x


class _ScannedBlock(nn.Module):
    """`Block` as an `nn.scan` step: (carry, unused) -> (carry, None)."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
        return Block(self.config, name="block")(x), None


class GPT(nn.Module):
    """Linen GPT: ``tokens`` int32[B, S] -> logits float32[B, S, vocab]."""

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        _check_tokens(tokens, c)
        s = tokens.shape[1]
        x = nn.Embed(
            c.vocab_size, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype,
            name="tok_embed",
        )(tokens)
        pos = self.param("pos_embed", _POS_EMBED_INIT, (c.seq_len, c.hidden), c.param_dtype)
        x = x + pos[None, :s].astype(c.dtype)
        if c.scan_layers:     # MaxText-style: one block, parameters stacked [num_layers, ...]
            blocks = nn.scan(_ScannedBlock, variable_axes={"params": 0},
                             split_rngs={"params": True}, length=c.num_layers)
            x, _ = blocks(c, name="blocks")(x, None)
        for i in range(0 if c.scan_layers else c.num_layers):
            x = Block(c, name=f"block_{i}")(x)
            if c.stage_boundaries and i < c.num_layers - 1:
                x = mark_stage_boundary(x)
        x = nn.LayerNorm(dtype=c.dtype, param_dtype=c.param_dtype, name="ln_f")(x)
        logits = nn.Dense(
            c.vocab_size, use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype,
            name="lm_head",
        )(x)
        return logits.astype(jnp.float32)


# ---------------------------------------------------------------------------
# Flax NNX
# ---------------------------------------------------------------------------


class NnxCausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = config
        dense = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
        self.num_heads = c.num_heads
        self.dtype = c.dtype
        self.qkv = nnx.Linear(c.hidden, 3 * c.hidden, **dense)
        self.out = nnx.Linear(c.hidden, c.hidden, **dense)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _causal_attention(self.qkv(x), self.num_heads, self.dtype)
        return self.out(y)


class NnxMlpBlock(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = config
        dense = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
        self.fc = nnx.Linear(c.hidden, c.mlp_hidden, **dense)
        self.proj = nnx.Linear(c.mlp_hidden, c.hidden, **dense)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(jax.nn.gelu(self.fc(x), approximate=True))


class NnxBlock(nnx.Module):
    """Pre-LayerNorm transformer block (NNX)."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = config
        ln = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
        self.ln_1 = nnx.LayerNorm(c.hidden, **ln)
        self.attn = NnxCausalSelfAttention(c, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(c.hidden, **ln)
        self.mlp = NnxMlpBlock(c, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NnxGPT(nnx.Module):
    """NNX GPT with the architecture and parameter names of :class:`GPT`.

    Blocks are attributes ``block_0``, ``block_1``, ... (not a list) so that
    parameter paths match the linen model one to one.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.tok_embed = nnx.Embed(
            c.vocab_size, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs
        )
        self.pos_embed = nnx.Param(
            _POS_EMBED_INIT(rngs.params(), (c.seq_len, c.hidden), c.param_dtype)
        )
        for i in range(c.num_layers):
            setattr(self, f"block_{i}", NnxBlock(c, rngs=rngs))
        self.ln_f = nnx.LayerNorm(
            c.hidden, dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs
        )
        self.lm_head = nnx.Linear(
            c.hidden, c.vocab_size, use_bias=False, dtype=c.dtype,
            param_dtype=c.param_dtype, rngs=rngs,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        _check_tokens(tokens, c)
        s = tokens.shape[1]
        x = self.tok_embed(tokens)
        x = x + self.pos_embed[...][None, :s].astype(c.dtype)
        for i in range(c.num_layers):
            x = getattr(self, f"block_{i}")(x)
            if c.stage_boundaries and i < c.num_layers - 1:
                x = mark_stage_boundary(x)
        logits = self.lm_head(self.ln_f(x))
        return logits.astype(jnp.float32)


# ---------------------------------------------------------------------------
# Loss, data, accounting
# ---------------------------------------------------------------------------


def megatron_rules(model_axis: str = "model", data_axis: str | None = "data",
                   batch_pattern: str = r"^batch") -> tuple[tuple[str, tuple], ...]:
    """Megatron-LM's tensor parallelism for :class:`GPT` as `autopar` ``sharding_rules``.

    Column-parallel ``qkv`` and ``fc`` (output features split over ``model_axis``), row-parallel
    ``out`` and ``proj`` (input features split), a vocabulary-parallel embedding and LM head,
    everything else replicated; batch leaves (paths matching ``batch_pattern``) split over
    ``data_axis``. Optimizer state follows its parameter (its path contains the parameter's).

    Example:
        >>> autopar.ShardParallel(sharding_rules=megatron_rules())
    """
    m = model_axis
    rules = [
        (r"\['(qkv|fc)'\]\['kernel'\]", (None, m)),
        (r"\['(qkv|fc)'\]\['bias'\]", (m,)),
        (r"\['(out|proj)'\]\['kernel'\]", (m, None)),
        (r"\['tok_embed'\]\['embedding'\]", (m, None)),
        (r"\['lm_head'\]\['kernel'\]", (None, m)),
    ]
    if data_axis is not None:
        rules.append((batch_pattern, (data_axis,)))
    return tuple(rules) + ((r".", ()),)


def gpt_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy: predict ``tokens[:, 1:]`` from ``logits[:, :-1]``.

    Mean over batch and positions, computed in float32.
    """
    logits = logits[:, :-1].astype(jnp.float32)
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_gpt_batch(key: jax.Array, batch_size: int, config: GPTConfig) -> dict[str, jax.Array]:
    """Random tokens int32[batch_size, seq_len] uniform in [0, vocab_size)."""
    tokens = jax.random.randint(
        key, (batch_size, config.seq_len), 0, config.vocab_size, dtype=jnp.int32
    )
    return {"tokens": tokens}


def _embedding_param_count(config: GPTConfig) -> int:
    return config.vocab_size * config.hidden + config.seq_len * config.hidden


def gpt_param_count(config: GPTConfig) -> int:
    """Exact number of parameters of :class:`GPT` / :class:`NnxGPT`.

    ``V*H + S*H + L*(4*H^2 + 2*m*H^2 + 9*H + m*H) + 2*H + H*V`` with
    V vocab, S seq_len, L layers, H hidden, m mlp_ratio (biases and LayerNorm
    scales/biases included; the LM head has no bias).
    """
    h, m, v = config.hidden, config.mlp_hidden, config.vocab_size
    per_block = (
        2 * h                    # ln_1
        + h * 3 * h + 3 * h      # attn/qkv
        + h * h + h              # attn/out
        + 2 * h                  # ln_2
        + h * m + m              # mlp/fc
        + m * h + h              # mlp/proj
    )
    return _embedding_param_count(config) + config.num_layers * per_block + 2 * h + h * v


def gpt_flops_per_token(config: GPTConfig) -> float:
    """Estimated FLOPs per token of one training step (forward + backward).

    Standard estimate (Kaplan et al. 2020; PaLM appendix B)::

        6 * N  +  12 * L * H * S

    * ``N`` = parameters that take part in matmuls: :func:`gpt_param_count`
      minus the token and position embedding tables (lookups, not matmuls);
      the untied LM head is included. Each such parameter costs 2 FLOPs per
      token forward and 4 backward.
    * ``12 * L * H * S``: attention scores ``q k^T`` and the weighted sum
      ``p v``, each ``2 * S * H`` FLOPs per token per layer forward, times 3
      for forward + backward. The causal mask is ignored (full S x S), as in
      the usual convention.

    Biases, LayerNorm, softmax and GELU are counted in N (biases) or ignored.
    """
    n = gpt_param_count(config) - _embedding_param_count(config)
    attention = 12 * config.num_layers * config.hidden * config.seq_len
    return float(6 * n + attention)
