"""Memory fidelity on a step written the NNX way: an in-place `nnx.Optimizer`, blocks in a
Python list each wrapped in `nnx.remat`, dropout, a mean-pooled head. Found 2026-11-28 (issue
24): the plan trains like `nnx.jit`, but its predicted peak is 0.83 of what XLA compiles
(10,766,460 vs 12,996,812 bytes on 2x4), outside the 10% the memory table asks for; under a
budget between the least and the fastest plan's memory, predicted 9,275,516 and compiled
13,471,948.

The cause (2026-11-29, the compiled step's schedule under both XLA:CPU schedulers): XLA:CPU
drops the optimization barriers of the user's `nnx.remat` before it schedules, and runs all
four blocks' recomputations before the first block's backward, so their recomputed fc1 and
gelu outputs (4 x 512 KiB each) are live together at the peak; the prediction recomputes each
block right before its backward, as GPU and TPU do. autopar's own recomputation is tied to the
cotangent on XLA:CPU (`inter_op/step_remat._tied`); the user's is not yet."""
import re

import jax
import optax
import pytest
from flax import nnx

import autopar
from autopar.verify.memory_check import compiled_bytes
from support.steps import mesh_of


class _Block(nnx.Module):
    def __init__(self, d, rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.fc2(nnx.gelu(self.fc1(self.ln(x)))))


class _Net(nnx.Module):
    def __init__(self, rngs, d=128, n=4):
        self.emb = nnx.Embed(256, d, rngs=rngs)
        self.blocks = nnx.List([_Block(d, rngs) for _ in range(n)])
        self.head = nnx.Linear(d, 256, rngs=rngs)

    def __call__(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = nnx.remat(lambda b, x: b(x))(b, x)
        return self.head(x.mean(axis=1))


def _step(model, opt, ids, y):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(ids), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


def _make():
    m = _Net(nnx.Rngs(0, dropout=1))
    return m, nnx.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Param)


@pytest.mark.slow   # an open fidelity gap (issue 24), measured in make test-slow
@pytest.mark.xfail(strict=True, reason="predicted 0.83 of compiled: XLA:CPU hoists the user's "
                   "recomputation (issue 24's memory rows)")
def test_nnx_remat_dropout_lm_predicted_within_10_percent():
    ids = [jax.random.randint(jax.random.key(i), (32, 64), 0, 256) for i in range(2)]
    ys = [jax.random.randint(jax.random.key(10 + i), (32,), 0, 256) for i in range(2)]
    ref_m, ref_o = _make()
    ref = [float(nnx.jit(_step)(ref_m, ref_o, i, y)) for i, y in zip(ids, ys)]
    m, o = _make()
    par = autopar.parallelize(_step, mesh=mesh_of((2, 4)), batch_argnums=(2, 3))
    got = [float(par(m, o, i, y)) for i, y in zip(ids, ys)]
    assert max(abs(a - b) / abs(a) for a, b in zip(ref, got)) < 1e-5     # trains like nnx.jit
    compiled = par.get_compiled(m, o, ids[0], ys[0])
    assert not re.search(r"all-to-all\(", compiled.as_text())
    total = compiled_bytes(compiled)
    predicted = par.get_plan(m, o, ids[0], ys[0]).peak_memory_bytes
    assert 0.9 <= predicted / total <= 1.1, (predicted, total)
