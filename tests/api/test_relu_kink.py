"""A third-party OPT-style ReLU decoder with dropout on a 2 x 4 mesh (issue 24): autopar's
gradient equals jax.jit's within 1e-5. Where a 2-D layout does differ (the issue measured 7e-4
norm-relative, 5.6e-5 without dropout), the cause is the ReLU's kink, not the plan: a unit whose
pre-activation lies within float32 rounding of zero falls on the other side of it under another
summation order, and its whole gradient term (one of about a million) moves. A hand-written
`jax.jit` with the plan's own argument and result shardings shows the same: the forward equal,
one `fc1` bias entry off by orders of magnitude more than every other; a smooth activation
(GELU) never shows it. (Against float64 with the same masks both float32 gradients are about
1e-3 off on such a seed: neither is wrong, each rounds to its side of the kink.)"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import autopar
from support.steps import mesh_of


class Attention(nn.Module):
    hidden: int
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, deterministic):
        b, t, h = x.shape
        hd = h // self.heads
        q = nn.Dense(h, name="q_proj")(x) * hd ** -0.5
        k, v = nn.Dense(h, name="k_proj")(x), nn.Dense(h, name="v_proj")(x)
        q, k, v = (a.reshape(b, t, self.heads, hd) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, None], s, jnp.finfo(s.dtype).min)
        p = nn.Dropout(self.dropout)(jax.nn.softmax(s, axis=-1), deterministic=deterministic)
        return nn.Dense(h, name="out_proj")(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, h))


class DecoderLayer(nn.Module):
    hidden: int
    heads: int
    ffn: int
    dropout: float
    act: str

    @nn.compact
    def __call__(self, x, deterministic):
        h = nn.LayerNorm(name="self_attn_layer_norm")(x)
        h = Attention(self.hidden, self.heads, self.dropout, name="self_attn")(h, deterministic)
        x = x + nn.Dropout(self.dropout)(h, deterministic=deterministic)
        h = getattr(nn, self.act)(nn.Dense(self.ffn, name="fc1")(
            nn.LayerNorm(name="final_layer_norm")(x)))
        h = nn.Dropout(self.dropout)(nn.Dense(self.hidden, name="fc2")(h),
                                     deterministic=deterministic)
        return x + h


class OPTDecoder(nn.Module):
    act: str = "relu"
    vocab: int = 512
    hidden: int = 256

    @nn.compact
    def __call__(self, ids, deterministic=True):
        emb = nn.Embed(self.vocab, self.hidden, name="embed_tokens")
        pos = nn.Embed(66, self.hidden, name="embed_positions")
        x = emb(ids) + pos(jnp.arange(ids.shape[1])[None] + 2)    # OPT's position offset
        x = nn.Dropout(0.1)(x, deterministic=deterministic)
        for i in range(2):
            x = DecoderLayer(self.hidden, 4, 1024, 0.1, self.act, name=f"layers_{i}")(
                x, deterministic)
        return emb.attend(nn.LayerNorm(name="final_layer_norm")(x))


def _case(act: str):
    """(jax.jit step, autopar step, hand-written jit with the plan's shardings, `run(fn, s)`:
    a step's outputs on the parameters and the batch of seed s)."""
    model, tx = OPTDecoder(act=act), optax.adamw(1e-3)
    ids = jax.random.randint(jax.random.key(1), (16, 64), 0, 512)
    params = model.init(jax.random.key(0), ids[:1])["params"]
    opt_state = tx.init(params)

    def loss_fn(params, batch, key):
        logits = model.apply({"params": params}, batch["ids"], deterministic=False,
                             rngs={"dropout": key})
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, batch["ids"][:, 1:, None], -1))

    def step(params, opt_state, batch, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    def data(s):
        return ({"ids": jax.random.randint(jax.random.key(1000 + s), ids.shape, 0, 512)},
                jax.random.fold_in(jax.random.key(42), s))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), batch_argnums=(2,))
    args = (params, opt_state, *data(0))
    outs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(jax.eval_shape(step, *args)),
                                        par.get_compiled(*args).output_shardings)
    hand = jax.jit(step, in_shardings=tuple(par.input_shardings(*args)), out_shardings=outs)
    return jax.jit(step), par, hand, lambda fn, s: fn(params, opt_state, *data(s))


def _rel(a, b) -> float:
    a = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(a)]
    b = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(b)]
    return float(np.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b)))
                 / np.sqrt(sum((x ** 2).sum() for x in a)))


@pytest.mark.slow   # the next test checks the same plan on seeds 0-7 (this one: 0-2)
def test_relu_decoder_2x4_gradient_equals_jit():
    ref_fn, par, _, run = _case("relu")
    for seed in range(3):
        assert _rel(run(ref_fn, seed)[3], run(par, seed)[3]) < 1e-5, seed


@pytest.mark.slow   # three compiles and 24 steps: make test-slow
def test_a_2x4_difference_is_one_relu_unit_and_a_hand_written_jit_shows_it():
    ref_fn, par, hand, run = _case("relu")
    flipped = None
    for seed in range(8):
        ref, by_hand = run(ref_fn, seed), run(hand, seed)
        assert _rel(ref[3], run(par, seed)[3]) < 1e-5, seed     # autopar's plan
        assert float(by_hand[2]) == pytest.approx(float(ref[2]), rel=1e-6)   # same forward
        if flipped is None and _rel(ref[3], by_hand[3]) > 1e-4:
            flipped = (ref[3], by_hand[3])
    if flipped is None:
        pytest.skip("no seed put a ReLU unit within rounding of zero under this XLA build")
    ref, by_hand = flipped
    assert _rel(ref, by_hand) < 3e-3
    spikes = []
    for layer in ("layers_0", "layers_1"):
        d = np.sort(np.abs(np.asarray(ref[layer]["fc1"]["bias"])
                           - np.asarray(by_hand[layer]["fc1"]["bias"])))
        spikes.append(d[-1] > 1000 * d[-2])
    assert any(spikes)       # one unit's gradient moved, the others agree to rounding


@pytest.mark.slow
def test_gelu_decoder_agrees_under_every_layout():
    ref_fn, par, hand, run = _case("gelu")
    for seed in range(8):
        ref = run(ref_fn, seed)
        assert _rel(ref[3], run(hand, seed)[3]) < 3e-6, seed
        assert _rel(ref[3], run(par, seed)[3]) < 1e-5, seed
