"""The tests' comparison rule (tests/support/equivalence.py) accepts a rounding-level difference and
still catches a real error: a gradient leaf off by 1e-3 of its scale, a dropped microbatch, a
skipped update."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from support.equivalence import (
    ROUTING_GRAD_RTOL,
    ROUTING_PARAM_RTOL,
    assert_equivalent,
    relative_norm_error,
)
from support.steps import make_case, mesh_of, run_steps, sgd_momentum_clip


def _synthetic(seed=0, steps=3):
    """(state, losses, grads) with the shapes of a small model's run."""
    rng = np.random.default_rng(seed)
    tree = lambda: {"w": rng.normal(size=(16, 8)).astype(np.float32),
                    "b": rng.normal(size=(8,)).astype(np.float32) * 0.1}
    return (tree(), ), [np.float32(2.0 - 0.1 * i) for i in range(steps)], [tree()
                                                                           for _ in range(steps)]


def _map(run, fn_state=None, fn_grads=None, fn_losses=None):
    state, losses, grads = run
    ident = lambda x, *_: x
    return ((jax.tree_util.tree_map(fn_state or ident, state[0]),),
            [(fn_losses or ident)(x, i) for i, x in enumerate(losses)],
            [jax.tree_util.tree_map(lambda g, i=i: (fn_grads or ident)(g, i), g)
             for i, g in enumerate(grads)])


def _rounding(x, *_):
    """x with a relative perturbation of a few float32 ulps in every entry."""
    noise = np.random.default_rng(x.size).uniform(-3, 3, size=np.shape(x))
    return (x * (1 + noise * np.finfo(np.float32).eps)).astype(np.float32)


@pytest.mark.parametrize("smooth", [True, False])
def test_rounding_level_differences_pass(smooth):
    ref = _synthetic()
    got = _map(ref, _rounding, _rounding, lambda x, i: np.float32(_rounding(np.float32(x))))
    assert_equivalent(ref, got, compare_params=True, smooth=smooth)


def test_a_routing_flip_after_step_0_passes_only_when_the_model_routes():
    """A flip moves one gradient term at step 2 by 5e-4 of the tree norm (measured on the
    max-pool CNN): the routing rule accepts it, the smooth rule does not."""
    ref = _synthetic()

    def flip(g, i):
        if i != 2 or g.ndim != 2:
            return g
        g = g.copy()
        g[3, :] += 5e-4 * float(np.linalg.norm(g)) / np.sqrt(g.shape[1])
        return g
    got = _map(ref, fn_grads=flip)
    assert 2e-4 < relative_norm_error(ref[2][2], got[2][2]) < ROUTING_GRAD_RTOL
    assert_equivalent(ref, got, compare_params=True, smooth=False)
    with pytest.raises(AssertionError, match="step 2: gradients differ"):
        assert_equivalent(ref, got, compare_params=True, smooth=True)


@pytest.mark.parametrize("smooth", [True, False])
def test_a_leaf_off_by_1e_3_of_its_scale_at_step_0_fails(smooth):
    ref = _synthetic()
    bump = lambda g, i: g + 1e-3 * np.max(np.abs(g)) if i == 0 and g.ndim == 1 else g
    with pytest.raises(AssertionError, match="step 0: gradients differ"):
        assert_equivalent(ref, _map(ref, fn_grads=bump), compare_params=False, smooth=smooth)


def test_a_leaf_off_by_1e_3_of_its_scale_at_a_later_step_fails_on_a_smooth_model():
    ref = _synthetic()
    bump = lambda g, i: g + 1e-3 * np.max(np.abs(g)) if i == 2 and g.ndim == 1 else g
    with pytest.raises(AssertionError, match="step 2: gradients differ"):
        assert_equivalent(ref, _map(ref, fn_grads=bump), compare_params=False, smooth=True)


@pytest.mark.parametrize("smooth", [True, False])
def test_parameters_off_beyond_the_rule_fail(smooth):
    ref = _synthetic()
    off = 2 * ROUTING_PARAM_RTOL if not smooth else 1e-3
    with pytest.raises(AssertionError, match="parameters differ"):
        assert_equivalent(ref, _map(ref, fn_state=lambda p: p * (1 + off)),
                          compare_params=True, smooth=smooth)


@pytest.mark.parametrize("step_off", [0, 1])
def test_a_loss_off_at_the_first_two_steps_fails_on_any_model(step_off):
    ref = _synthetic()
    off = lambda x, i: np.float32(x * (1 + 1e-4)) if i == step_off else x
    with pytest.raises(AssertionError, match=f"step {step_off}: loss"):
        assert_equivalent(ref, _map(ref, fn_losses=off), compare_params=False, smooth=False)


def test_structure_mismatch_fails():
    ref = _synthetic()
    state, losses, grads = ref
    with pytest.raises(AssertionError, match="structure"):
        assert_equivalent(ref, (state, losses, [dict(g, extra=g["b"]) for g in grads]),
                          compare_params=False)


@pytest.fixture(scope="module")
def mlp_run():
    """A ReLU MLP (a routing model) under gradient accumulation against jax.jit."""
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(), batch_size=16,
                                     value_and_grad=autopar.value_and_grad)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), batch_argnums=(1,),
                              method=autopar.ShardParallel(num_microbatches=4))
    return step, state, batches, par, run_steps(jax.jit(step), state, batches)


def test_real_accumulation_run_passes(mlp_run):
    step, state, batches, par, ref = mlp_run
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True)


def test_a_dropped_microbatch_fails(mlp_run):
    """The gradient of three of the four microbatches (what an accumulator that skips one
    computes) is caught at step 0."""
    step, state, batches, par, ref = mlp_run
    three_quarters = [jax.tree_util.tree_map(lambda x: x[:12], b) for b in batches]
    dropped = run_steps(jax.jit(step), state, three_quarters)
    with pytest.raises(AssertionError, match="step 0"):
        assert_equivalent(ref, dropped, compare_params=True)


def test_a_skipped_update_fails(mlp_run):
    """A step that returns its input state (the update lost) is caught at step 1's loss."""
    step, state, batches, par, ref = mlp_run

    def lost_update(s, b):
        _, loss, grads = step(s, b)
        return s, loss, grads
    with pytest.raises(AssertionError, match="step 1: loss"):
        assert_equivalent(ref, run_steps(jax.jit(lost_update), state, batches),
                          compare_params=True)


def test_relative_norm_error_is_the_tree_norm():
    a = {"x": jnp.ones((3,)), "y": jnp.zeros((2,))}
    b = {"x": jnp.ones((3,)), "y": jnp.array([0.0, np.sqrt(3.0) * 0.01])}
    assert relative_norm_error(a, b) == pytest.approx(0.01)
