"""A GShard-style mixture-of-experts transformer language model in ``flax.linen``.

The GPT of :mod:`models.gpt` with the MLP of every ``expert_every``-th block
replaced by a top-2 routed mixture of ``num_experts`` experts (Lepikhin et al.
2020, "GShard", Algorithm 1; the MoE model of Alpa's evaluation).

Routing groups are single sequences: the capacity, the positions in the
experts and the load-balancing loss of one example depend only on that
example's tokens. Splitting a batch into microbatches therefore changes
nothing (the losses are means over examples). The math is deterministic and
static-shaped: no RNG at apply time, no jitter, no random second-expert
routing; tokens over an expert's capacity are dropped (their MoE output is
zero and the residual connection carries them through).

Dispatch and combine are einsums with a mask of shape [group, tokens,
experts, capacity], and the expert weights are stacked along a leading
expert dimension, so that a sharding compiler can partition the experts::

    block_{i}/moe/router          [hidden, experts]       (no bias; float32 math)
    block_{i}/moe/fc_kernel       [experts, hidden, mlp_hidden]
    block_{i}/moe/fc_bias         [experts, mlp_hidden]
    block_{i}/moe/proj_kernel     [experts, mlp_hidden, hidden]
    block_{i}/moe/proj_bias       [experts, hidden]

Blocks that are not MoE blocks, embeddings, ``ln_f`` and ``lm_head`` have
the names and shapes of :class:`models.gpt.GPT`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.frontend.markers import mark_stage_boundary
from autopar.models.gpt import (
    _POS_EMBED_INIT,
    CausalSelfAttention,
    GPTConfig,
    MlpBlock,
    check_positive_ints,
    megatron_rules,
)

Dtype = Any

_EXPERT_INIT = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Hyper-parameters of :class:`MoE`.

    Block ``i`` is an MoE block when ``(i + 1) % expert_every == 0`` (with
    ``expert_every=2``: blocks 1, 3, ...; with 1: every block). Each expert
    processes at most :func:`expert_capacity` tokens of a sequence.
    """

    vocab_size: int = 1024
    seq_len: int = 64
    num_layers: int = 2
    hidden: int = 128
    num_heads: int = 4
    mlp_ratio: int = 4
    num_experts: int = 4
    expert_every: int = 2
    capacity_factor: float = 2.0
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    stage_boundaries: bool = False

    def __post_init__(self):
        check_positive_ints(self, ("num_experts", "expert_every"))
        if self.num_experts < 2:
            raise ValueError(
                f"MoEConfig.num_experts must be >= 2 for top-2 routing, got {self.num_experts}."
            )
        if not self.capacity_factor > 0:
            raise ValueError(
                f"MoEConfig.capacity_factor must be > 0, got {self.capacity_factor!r}."
            )
        try:
            _ = self.gpt  # validates the shared transformer fields
        except ValueError as e:
            raise ValueError(str(e).replace("GPTConfig", "MoEConfig")) from None

    @property
    def gpt(self) -> GPTConfig:
        """The dense transformer part, as a :class:`GPTConfig`."""
        return GPTConfig(
            vocab_size=self.vocab_size, seq_len=self.seq_len, num_layers=self.num_layers,
            hidden=self.hidden, num_heads=self.num_heads, mlp_ratio=self.mlp_ratio,
            dtype=self.dtype, param_dtype=self.param_dtype,
        )

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.hidden

    def is_moe_block(self, i: int) -> bool:
        return (i + 1) % self.expert_every == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.num_layers))


def expert_capacity(config: MoEConfig, group_size: int | None = None) -> int:
    """Tokens one expert takes from one group (sequence) of ``group_size`` tokens.

    ``ceil(capacity_factor * 2 * group_size / num_experts)`` (two choices per
    token), at least 1 and at most ``group_size`` (an expert never gets more
    than one slot per token). ``group_size`` defaults to ``seq_len``.
    """
    s = config.seq_len if group_size is None else group_size
    c = math.ceil(config.capacity_factor * 2 * s / config.num_experts)
    return max(1, min(c, s))


# ---------------------------------------------------------------------------
# Top-2 gating (GShard Algorithm 1, without the random second-expert policy)
# ---------------------------------------------------------------------------


def top2_gating(router_logits: jax.Array, capacity: int):
    """Top-2 routing of each group's tokens to experts with a per-expert capacity.

    Args:
      router_logits: float32[G, S, E], for G groups of S tokens and E experts.
      capacity: slots per expert and group.

    Returns:
      ``(dispatch, combine, aux)``: ``dispatch`` float32[G, S, E, C] is 1 where
      token s goes to slot c of expert e; ``combine`` [G, S, E, C] holds the
      weight of that slot's output in token s's result; ``aux`` float32[G] is
      the load-balancing loss ``E * sum_e(fraction of tokens whose first choice
      is e * mean gate of e)`` (1 when balanced).

    Each token picks its best expert (top-1) and its best other expert
    (top-2). Slots are filled in token order, all top-1 choices before any
    top-2 choice; a choice finding its expert full is dropped. The two gate
    values are normalized to sum to one before drops, so a token that loses
    one choice keeps only that choice's share.
    """
    e = router_logits.shape[-1]
    logits = router_logits.astype(jnp.float32)
    gates = jax.nn.softmax(logits, axis=-1)
    mask_1 = jax.nn.one_hot(jnp.argmax(logits, axis=-1), e, dtype=jnp.float32)
    others = jnp.where(mask_1 > 0, -jnp.inf, logits)  # never the top-1 expert again
    mask_2 = jax.nn.one_hot(jnp.argmax(others, axis=-1), e, dtype=jnp.float32)
    gate_1 = jnp.sum(gates * mask_1, axis=-1)
    gate_2 = jnp.sum(gates * mask_2, axis=-1)

    # Load balance, measured on the first choices before capacity drops.
    aux = e * jnp.sum(jnp.mean(mask_1, axis=1) * jnp.mean(gates, axis=1), axis=-1)

    # Position of each choice in its expert's buffer; over capacity -> dropped.
    pos_1 = jnp.cumsum(mask_1, axis=1) - 1.0
    mask_1 = mask_1 * (pos_1 < capacity)
    pos_2 = jnp.cumsum(mask_2, axis=1) - 1.0 + jnp.sum(mask_1, axis=1, keepdims=True)
    mask_2 = mask_2 * (pos_2 < capacity)

    denom = gate_1 + gate_2 + jnp.finfo(jnp.float32).eps

    def slot(pos, mask):  # one-hot of each kept choice's position, [G, S, C]
        index = jnp.sum(pos * mask, axis=-1).astype(jnp.int32)
        return jax.nn.one_hot(index, capacity, dtype=jnp.float32)

    slot_1, slot_2 = slot(pos_1, mask_1), slot(pos_2, mask_2)
    dispatch_1 = mask_1[..., None] * slot_1[:, :, None, :]
    dispatch_2 = mask_2[..., None] * slot_2[:, :, None, :]
    dispatch = dispatch_1 + dispatch_2
    combine = ((gate_1 / denom)[..., None, None] * dispatch_1
               + (gate_2 / denom)[..., None, None] * dispatch_2)
    return dispatch, combine, aux


# ---------------------------------------------------------------------------
# flax.linen
# ---------------------------------------------------------------------------


class MoeMlp(nn.Module):
    """Top-2 mixture of GELU MLP experts; returns ``(y [B,S,H], aux float32[B])``."""

    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array):
        c = self.config
        b, s, h = x.shape
        e, f = c.num_experts, c.mlp_hidden
        router = self.param("router", nn.initializers.lecun_normal(), (h, e), c.param_dtype)
        fc_k = self.param("fc_kernel", _EXPERT_INIT, (e, h, f), c.param_dtype)
        fc_b = self.param("fc_bias", nn.initializers.zeros, (e, f), c.param_dtype)
        proj_k = self.param("proj_kernel", _EXPERT_INIT, (e, f, h), c.param_dtype)
        proj_b = self.param("proj_bias", nn.initializers.zeros, (e, h), c.param_dtype)

        # One routing group per sequence: G = B, S tokens per group.
        logits = jnp.einsum("gsm,me->gse", x.astype(jnp.float32), router.astype(jnp.float32))
        dispatch, combine, aux = top2_gating(logits, expert_capacity(c, s))
        dispatch, combine = dispatch.astype(c.dtype), combine.astype(c.dtype)

        xe = jnp.einsum("gsec,gsm->egcm", dispatch, x.astype(c.dtype))
        he = jnp.einsum("egcm,emf->egcf", xe, fc_k.astype(c.dtype))
        he = jax.nn.gelu(he + fc_b.astype(c.dtype)[:, None, None, :], approximate=True)
        ye = jnp.einsum("egcf,efm->egcm", he, proj_k.astype(c.dtype))
        ye = ye + proj_b.astype(c.dtype)[:, None, None, :]
        y = jnp.einsum("gsec,egcm->gsm", combine, ye)
        return y, aux


class MoEBlock(nn.Module):
    """Pre-LayerNorm transformer block; the MLP is :class:`MoeMlp` or dense."""

    config: MoEConfig
    moe: bool

    @nn.compact
    def __call__(self, x: jax.Array, aux: jax.Array):
        c = self.config
        ln = dict(dtype=c.dtype, param_dtype=c.param_dtype)
        x = x + CausalSelfAttention(c.gpt, name="attn")(nn.LayerNorm(name="ln_1", **ln)(x))
        y = nn.LayerNorm(name="ln_2", **ln)(x)
        if self.moe:
            y, layer_aux = MoeMlp(c, name="moe")(y)
            aux = aux + layer_aux
        else:
            y = MlpBlock(c.gpt, name="mlp")(y)
        return x + y, aux


class MoE(nn.Module):
    """Linen MoE LM: ``tokens`` int32[B, S] -> logits float32[B, S, vocab].

    With ``return_aux=True`` returns ``(logits, aux)``, ``aux`` float32[B] the
    per-example load-balancing loss summed over the MoE layers (pass it to
    :func:`moe_loss`). With ``config.stage_boundaries`` the pair ``(x, aux)``
    is marked with :func:`autopar.mark_stage_boundary` between blocks.
    """

    config: MoEConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, return_aux: bool = False):
        c = self.config
        if tokens.ndim != 2 or tokens.shape[1] > c.seq_len:
            raise ValueError(
                f"MoE expects tokens of shape [batch, seq] with seq <= MoEConfig.seq_len "
                f"({c.seq_len}), got shape {tokens.shape}."
            )
        s = tokens.shape[1]
        x = nn.Embed(c.vocab_size, c.hidden, dtype=c.dtype, param_dtype=c.param_dtype,
                     name="tok_embed")(tokens)
        pos = self.param("pos_embed", _POS_EMBED_INIT, (c.seq_len, c.hidden), c.param_dtype)
        x = x + pos[None, :s].astype(c.dtype)
        aux = jnp.zeros((tokens.shape[0],), jnp.float32)
        for i in range(c.num_layers):
            x, aux = MoEBlock(c, c.is_moe_block(i), name=f"block_{i}")(x, aux)
            if c.stage_boundaries and i < c.num_layers - 1:
                x, aux = mark_stage_boundary(x, aux)
        x = nn.LayerNorm(dtype=c.dtype, param_dtype=c.param_dtype, name="ln_f")(x)
        logits = nn.Dense(c.vocab_size, use_bias=False, dtype=c.dtype,
                          param_dtype=c.param_dtype, name="lm_head")(x)
        logits = logits.astype(jnp.float32)
        return (logits, aux) if return_aux else logits


# ---------------------------------------------------------------------------
# Loss, data, accounting
# ---------------------------------------------------------------------------


def megatron_moe_rules(model_axis: str = "model", data_axis: str | None = "data",
                       batch_pattern: str = r"^batch") -> tuple[tuple[str, tuple], ...]:
    """Megatron-LM's tensor parallelism for :class:`MoE` as `autopar` ``sharding_rules``: the
    GPT rules (:func:`models.gpt.megatron_rules`), and inside every expert the same column/row
    split of its MLP (``fc_kernel`` [E,H,F] split on F, ``proj_kernel`` [E,F,H] on F); no
    expert parallelism (Megatron-LM has none), router replicated.

    Example:
        >>> autopar.ShardParallel(sharding_rules=megatron_moe_rules())
    """
    m = model_axis
    experts = ((r"\['fc_kernel'\]", (None, None, m)), (r"\['fc_bias'\]", (None, m)),
               (r"\['proj_kernel'\]", (None, m, None)))
    return experts + megatron_rules(model_axis, data_axis, batch_pattern)


def moe_loss(logits: jax.Array, tokens: jax.Array, aux: jax.Array | None = None,
             *, aux_weight: float = 0.01) -> jax.Array:
    """Next-token cross-entropy (as :func:`models.gpt.gpt_loss`) plus
    ``aux_weight * mean(aux)``; both terms are means over examples."""
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()
    if aux is None:
        return ce
    return ce + aux_weight * jnp.mean(aux.astype(jnp.float32))


def make_moe_batch(key: jax.Array, batch_size: int, config: MoEConfig) -> dict[str, jax.Array]:
    """Random tokens int32[batch_size, seq_len] uniform in [0, vocab_size)."""
    tokens = jax.random.randint(
        key, (batch_size, config.seq_len), 0, config.vocab_size, dtype=jnp.int32)
    return {"tokens": tokens}


def _dense_block_param_count(config: MoEConfig) -> int:
    h, m = config.hidden, config.mlp_hidden
    return 4 * h + 4 * h * h + 4 * h + 2 * h * m + m + h   # 2 LN, attn, dense MLP


def _expert_param_count(config: MoEConfig) -> int:
    h, m = config.hidden, config.mlp_hidden
    return 2 * h * m + m + h


def moe_param_count(config: MoEConfig) -> int:
    """Exact number of parameters of :class:`MoE`.

    A dense block has the parameters of a GPT block; an MoE block replaces its
    MLP (``2*H*m + m + H``) by a router ``H*E`` and ``E`` such MLPs.
    """
    h, v, e = config.hidden, config.vocab_size, config.num_experts
    mlp = _expert_param_count(config)
    moe_block = _dense_block_param_count(config) - mlp + h * e + e * mlp
    n_moe = config.num_moe_layers
    blocks = n_moe * moe_block + (config.num_layers - n_moe) * _dense_block_param_count(config)
    return v * h + config.seq_len * h + blocks + 2 * h + h * v


def moe_flops_per_token(config: MoEConfig) -> float:
    """Estimated FLOPs per token of one training step (forward + backward).

    As :func:`models.gpt.gpt_flops_per_token` (``6 * N + 12 * L * H * S``),
    where ``N`` counts the non-embedding matmul parameters a token actually
    meets: the dense blocks, the LM head, the routers and, per MoE layer, the
    expert MLP times the expert slots per token ``E * C / S`` (computed even
    when empty). Plus, per MoE layer, ``6 * 2 * E * C * H / S * 2`` for the
    dispatch and combine einsums.
    """
    h, s, e = config.hidden, config.seq_len, config.num_experts
    slots_per_token = e * expert_capacity(config) / s
    n_moe = config.num_moe_layers
    dense = ((config.num_layers - n_moe) * _dense_block_param_count(config)
             + n_moe * (_dense_block_param_count(config) - _expert_param_count(config) + h * e)
             + 2 * h + h * config.vocab_size)
    experts = n_moe * slots_per_token * _expert_param_count(config)
    dispatch_combine = n_moe * 6 * 2 * 2 * slots_per_token * h
    attention = 12 * config.num_layers * h * s
    return float(6 * (dense + experts) + dispatch_combine + attention)
