"""`inter_op.reduction`: how each loss output combines over microbatches, read from the loss's
graph at the microbatch size next to the full-size one (no devices, no compilation)."""
import warnings

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import pytest

import autopar
from autopar.frontend.tracer import trace
from autopar.inter_op.pipeline import split_step
from autopar.inter_op.pipeshard import microbatch_args
from autopar.inter_op.reduction import Combine, reduce_outputs

W = jax.random.normal(jax.random.key(0), (4, 4))
BATCH = {"x": jax.random.normal(jax.random.key(1), (8, 4)),
         "y": jax.random.normal(jax.random.key(2), (8, 4))}


def _loss(fn, num_microbatches=4, has_aux=False):
    """The LossGraph of a step taking autopar.value_and_grad(fn)(w, x, y)."""
    def step(w, batch):
        value, g = autopar.value_and_grad(fn, has_aux=has_aux)(w, batch["x"], batch["y"])
        return w - g, value
    args = (W, BATCH)
    full = trace(step, args, batch_argnums=(1,), keep_grad=True)
    micro = trace(step, microbatch_args(args, (1,), num_microbatches), batch_argnums=(1,),
                  keep_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = split_step(full, micro, num_microbatches)
    return loss, [w for w in caught if issubclass(w.category, autopar.MicrobatchReductionWarning)]


def _combines(fn, **kw):
    loss, caught = _loss(fn, **kw)
    return [o.combine.value for o in loss.reduction.outputs], caught


def err(w, x, y):
    return (jnp.tanh(x @ w) - y) ** 2          # [B, 4], per example


def mask(y):
    return jnp.where(y[:, 0] > 0, 1.0, 0.0)    # uneven weights from the batch


@pytest.mark.parametrize("name,fn,want", [
    ("mean", lambda w, x, y: jnp.mean(err(w, x, y)), "mean"),
    ("mean of per-example means", lambda w, x, y: err(w, x, y).mean(-1).mean(), "mean"),
    ("mean plus weight decay", lambda w, x, y: jnp.mean(err(w, x, y)) + 1e-2 * jnp.sum(w ** 2),
     "mean"),
    ("sum", lambda w, x, y: jnp.sum(err(w, x, y)), "sum"),
    ("sum over a fixed count", lambda w, x, y: jnp.sum(err(w, x, y)) / 8.0, "sum"),
    ("sum scaled before the reduction", lambda w, x, y: jnp.sum(0.5 * err(w, x, y)), "sum"),
    ("per-example terms over the batch size",
     lambda w, x, y: jnp.sum(err(w, x, y) / x.shape[0]), "mean"),
    ("padded ratio", lambda w, x, y: jnp.sum(err(w, x, y).sum(-1) * mask(y)) / jnp.sum(mask(y)),
     "ratio"),
    ("ratio of means", lambda w, x, y: jnp.mean(err(w, x, y).sum(-1) * mask(y)) / jnp.mean(
        mask(y)), "ratio"),
    ("clamped denominator", lambda w, x, y: jnp.sum(err(w, x, y).sum(-1) * mask(y)) / jnp.maximum(
        jnp.sum(mask(y)), 1.0), "ratio"),
    ("denominator plus an epsilon", lambda w, x, y: jnp.sum(err(w, x, y).sum(-1) * mask(y)) / (
        jnp.sum(mask(y)) + 1e-8), "ratio"),
    ("denominator of the square root of a count", lambda w, x, y: jnp.sum(
        err(w, x, y).sum(-1) * mask(y)) / jnp.sqrt(jnp.where(x[:, 0] > 0, 1.0, 0.0).sum() + 1.0),
     "ratio"),
])
def test_exact_losses(name, fn, want):
    got, caught = _combines(fn)
    assert got == [want] and not caught, (name, got)


@pytest.mark.parametrize("name,fn,reason", [
    ("exp of a mean", lambda w, x, y: jnp.exp(jnp.mean(err(w, x, y))), "not a sum or ratio"),
    ("max over the batch", lambda w, x, y: jnp.max(err(w, x, y)), "not a sum over examples"),
    ("sum plus weight decay", lambda w, x, y: jnp.sum(err(w, x, y)) + jnp.sum(w ** 2),
     "plus a term free of the batch"),
    ("denominator with the parameters",
     lambda w, x, y: jnp.sum(err(w, x, y)) / jnp.sum(jnp.exp(x @ w)), "depends on the parameters"),
    ("batch statistics (BatchNorm)",
     lambda w, x, y: jnp.mean((x - x.mean(0)) @ w), "mix examples"),
])
def test_inexact_losses_warn(name, fn, reason):
    loss, caught = _loss(fn)
    assert loss.reduction.loss.combine == Combine.UNKNOWN, name
    assert reason in loss.reduction.loss.reason
    (w,) = caught
    text = str(w.message)
    assert "num_microbatches=4: the loss (shape ()" in text and "test_reduction.py" in text
    assert "and so is its gradient" in text and "Fix: " in text


def test_auxiliary_outputs():
    def fn(w, x, y):
        e = err(w, x, y)
        return jnp.mean(e), {
            "per_example": e.sum(-1), "logits": x @ w, "flat": e.reshape(-1),
            "transposed": e.T, "mean": jnp.mean(e), "count": jnp.sum(e > 1),
            "ratio": jnp.sum(e[:, 0] * mask(y)) / jnp.sum(mask(y)), "params": jnp.sum(w),
            "max": jnp.max(e)}
    loss, caught = _loss(fn, has_aux=True)
    red, fwd = loss.reduction, loss.forward
    # aux leaves in key order: count, flat, logits, max, mean, params, per_example, ratio,
    # transposed
    got = [(o.combine.value, o.batch_dim) for o in red.outputs]
    assert got == [("mean", None), ("sum", None), ("concat", 0), ("concat", 0),
                   ("unknown", None), ("mean", None), ("mean", None), ("concat", 0),
                   ("ratio", None), ("concat", 1)]
    assert red.rows == 2
    (ratio,) = [o for o in red.outputs if o.combine == Combine.RATIO]
    assert red.dens == (ratio.den,) and fwd.tensors[ratio.den].shape == ()
    assert red.den_inputs == (2,)            # y only: the weights come from the batch alone
    (w,) = caught
    assert "auxiliary output 3" in str(w.message) and "averaged" in str(w.message)


def test_without_the_full_size_graph_sums_and_means_are_unknown():
    """Literals cannot be compared: a mean could be a sum; only shapes are sure."""
    loss, _ = _loss(lambda w, x, y: (jnp.mean(err(w, x, y)), x @ w), has_aux=True)
    red = reduce_outputs(loss.forward, None, batch_inputs=loss.batch_inputs,
                         num_diff=loss.num_diff, num_microbatches=4)
    assert [o.combine for o in red.outputs] == [Combine.UNKNOWN, Combine.CONCAT]
    node = loss.step.nodes[loss.grad_node]
    full = trace(jcore.jaxpr_as_fun(node.eqn.params["jaxpr"]),
                 [jax.ShapeDtypeStruct(a.shape, a.dtype)
                  for a in node.eqn.params["jaxpr"].in_avals])
    with_full = reduce_outputs(loss.forward, full, batch_inputs=loss.batch_inputs,
                               num_diff=loss.num_diff, num_microbatches=4)
    assert [o.combine for o in with_full.outputs] == [Combine.MEAN, Combine.CONCAT]


def test_one_microbatch_needs_no_reduction():
    loss, caught = _loss(lambda w, x, y: jnp.exp(jnp.mean(err(w, x, y))), num_microbatches=1)
    assert loss.reduction is None and not caught


def test_random_keys_read_by_the_loss_are_listed():
    """A dropout key read by the loss (each microbatch folds in its index); random bits drawn
    at the microbatch's shape keep a mean loss exact."""
    def fn(w, x, y, key):
        keep = jax.random.bernoulli(key, 0.9, x.shape)
        return jnp.mean(err(w, jnp.where(keep, x / 0.9, 0.0), y))

    def step(w, batch, key):
        loss, g = autopar.value_and_grad(fn)(w, batch["x"], batch["y"], key)
        return w - g, loss
    args = (W, BATCH, jax.random.key(7))
    full = trace(step, args, batch_argnums=(1,), keep_grad=True)
    micro = trace(step, microbatch_args(args, (1,), 4), batch_argnums=(1,), keep_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.MicrobatchReductionWarning)
        loss = split_step(full, micro, 4)
    assert loss.reduction.loss.combine == Combine.MEAN
    assert loss.reduction.rng_inputs == (3,)      # w, x, y, key
    # the mask has the batch: each microbatch draws its rows of the whole batch's, no fold
    assert [(d.primitive, d.shape, d.dim, d.per_example) for d in loss.reduction.draws] == [
        ("random_bits", (2, 4), 0, 1)]
    assert not loss.reduction.folds_keys


def _draw_case(draw, batch_argnums=(1,)):
    """The reduction of a loss whose mask is `draw(key, x)` (x: [8 / 4, 4] per microbatch)."""
    def fn(w, x, y, key):
        return jnp.mean(err(w, x * draw(key, x), y))

    def step(w, batch, key):
        loss, g = autopar.value_and_grad(fn)(w, batch["x"], batch["y"], key)
        return w - g, loss
    args = (W, BATCH, jax.random.key(7))
    full = trace(step, args, batch_argnums=batch_argnums, keep_grad=True)
    micro = trace(step, microbatch_args(args, batch_argnums, 4), batch_argnums=batch_argnums,
                  keep_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = split_step(full, micro, 4)
    return loss.reduction, [str(w.message) for w in caught
                            if issubclass(w.category, autopar.MicrobatchReductionWarning)]


def test_batch_draws_found_flattened_and_the_ones_that_fold_keys_warn():
    # a draw flattened with the features: 4 entries per example along dimension 0
    red, caught = _draw_case(lambda k, x: jax.random.uniform(k, (x.size,)).reshape(x.shape))
    assert [(d.shape, d.dim, d.per_example) for d in red.draws] == [((8,), 0, 4)]
    assert not caught and not red.folds_keys
    # a draw without the batch is the same in every microbatch: nothing to do, nothing folded
    red, caught = _draw_case(lambda k, x: jax.random.uniform(k, x.shape[1:]))
    assert red.draws == () and not red.fold_reason and not caught
    # per-example keys split from the key: the split draws its rows of the whole batch's keys
    red, caught = _draw_case(lambda k, x: jax.vmap(
        lambda kk: jax.random.uniform(kk, x.shape[1:]))(jax.random.split(k, x.shape[0])))
    assert [d.primitive for d in red.draws] == ["random_split"] and not caught
    # a draw over examples x examples cannot be split into microbatches: folded, with a warning
    red, caught = _draw_case(lambda k, x: jax.random.uniform(k, (x.shape[0], x.shape[0]))
                             .sum(1, keepdims=True))
    assert red.folds_keys and "not one dimension 4 times larger" in red.fold_reason
    assert any("fold_in(key, m)" in c for c in caught)
    # a mask with the batch and a noise without it, both [2, 4] per microbatch: the stage
    # executables could not tell them apart, so the keys fold (with the warning)
    red, caught = _draw_case(lambda k, x: jax.random.uniform(k, x.shape)
                             + jax.random.uniform(jax.random.fold_in(k, 1), (2, 4)).sum())
    assert red.folds_keys and "the same shape (2, 4)" in red.fold_reason


def test_draws_fold_keys_where_threefry_is_not_partitionable():
    old = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        red, caught = _draw_case(lambda k, x: jax.random.uniform(k, x.shape))
    finally:
        jax.config.update("jax_threefry_partitionable", old)
    assert red.folds_keys and "jax_threefry_partitionable is off" in red.fold_reason
    assert any("jax_threefry_partitionable" in c for c in caught)


def test_microbatches_of_one_example():
    """The batch dimension is followed at the full size: at one example per microbatch it has
    size 1, like any other unit dimension. Where the two sizes trace to different graphs
    (`take_along_axis` drops a unit dimension), nothing is assumed: the loss warns."""
    def fn(w, x, y):
        e = err(w, x, y)
        return jnp.sum(e.sum(-1) * mask(y)) / jnp.sum(mask(y)), (jnp.mean(e), x @ w)
    got, caught = _combines(fn, num_microbatches=8, has_aux=True)
    assert got == ["ratio", "mean", "concat"] and not caught

    def picked(w, x, y):
        return jnp.mean(jnp.take_along_axis(err(w, x, y), jnp.argmax(y, -1)[:, None], axis=-1))
    assert _combines(picked, num_microbatches=4)[0] == ["mean"]
    got, caught = _combines(picked, num_microbatches=8)
    assert got == ["unknown"] and len(caught) == 1
