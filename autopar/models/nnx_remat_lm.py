"""A small Flax NNX classifier over token sequences, written the way the NNX guides write one:
blocks in an ``nnx.List``, each called through ``nnx.remat``, dropout drawn from the model's
own ``nnx.Rngs`` stream, a mean-pooled head, and a step that updates the model and its
``nnx.Optimizer`` in place under ``nnx.value_and_grad``.

Example:
    >>> model, optimizer = make_nnx_remat_lm()                      # doctest: +SKIP
    >>> loss = nnx.jit(train_step)(model, optimizer, ids, labels)    # doctest: +SKIP
"""
from __future__ import annotations

import optax
from flax import nnx


class Block(nnx.Module):
    """LayerNorm, a 4x GELU MLP and dropout, added to the input (no dropout at rate 0: the
    model's rng stream is left alone, as a pipeline's microbatched loss needs)."""

    def __init__(self, d: int, rngs: nnx.Rngs, dropout: float = 0.1):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else \
            nnx.Dropout(0.0, deterministic=True)   # no rngs: a stream it would advance

    def __call__(self, x):
        return x + self.drop(self.fc2(nnx.gelu(self.fc1(self.ln(x)))))


class RematLM(nnx.Module):
    """Token embedding, ``num_blocks`` blocks each recomputed in the backward pass
    (``nnx.remat``), mean pooling over the sequence and a classifier over ``vocab`` labels."""

    def __init__(self, rngs: nnx.Rngs, d: int = 128, num_blocks: int = 4, vocab: int = 256,
                 dropout: float = 0.1):
        self.emb = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs, dropout) for _ in range(num_blocks)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = nnx.remat(lambda b, x: b(x))(b, x)
        return self.head(x.mean(axis=1))


def train_step(model: RematLM, optimizer: nnx.Optimizer, ids, labels):
    """One AdamW step in place; returns the loss."""
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(ids), labels).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def make_nnx_remat_lm(seed: int = 0, **kw) -> tuple[RematLM, nnx.Optimizer]:
    """A fresh model (dropout stream seeded ``seed + 1``) and its AdamW optimizer."""
    model = RematLM(nnx.Rngs(seed, dropout=seed + 1), **kw)
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
