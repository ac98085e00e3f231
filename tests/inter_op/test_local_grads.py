"""Local gradient accumulation (`inter_op.local_grads`): with several microbatches, each
parameter gradient is reduced over the data axes once per step, not once per microbatch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.cost.hlo import collectives, loop_body_collectives, summary
from autopar.frontend.tracer import trace
from autopar.inter_op.local_grads import find_local_grads, partial_spec
from autopar.intra_op.batch_dims import batch_dims
from autopar.models.mlp import mse_loss
from autopar.runtime.compile_only import abstract_args
from support.steps import mesh_of, mlp_adam_state, two_stages_2x2


def _local(fun, *args):
    """find_local_grads on `fun`'s graph, every graph output counted as a gradient, with the
    batch (argument 1 on) split over mesh axis 0 on its batch dimension."""
    g = trace(fun, args, batch_argnums=tuple(range(1, len(args))))
    dims = batch_dims(g)
    spec_of = lambda t: tuple((0,) if d == dims[t] else () for d in range(g.tensors[t].rank))
    return g, find_local_grads(g, spec_of, dims, g.outputs)


def test_linear_chains_keep_partials_and_nonlinear_ones_reduce():
    w, x, y = jnp.ones((3, 4)), jnp.ones((8, 3)), jnp.ones((8, 4))
    g, local = _local(lambda w, x, y: ((x.T @ y) * 2.0 + (x.T @ y).T.T, y.sum(0)), w, x, y)
    assert local.grad_outputs == (True, True)
    assert len(local.reducers) == 3 and set(local.reducers.values()) == {(0,)}
    _, local = _local(lambda w, x, y: (jnp.tanh(x.T @ y), (x.T @ y) * 2.0), w, x, y)
    assert local.grad_outputs == (False, True)       # tanh of a partial sum is not exact
    _, local = _local(lambda w, x, y: (x.T @ y + w @ jnp.ones((4, 4)),), w, x, y)
    assert local.grad_outputs == (False,)           # a full value added to a partial one
    assert partial_spec(((1,), ()), (0,)) == ((0,), (1,), ())


def _mlp_state(hidden=64, layers=3, batch_size=32):
    return mlp_adam_state(hidden, layers, batch_size)


def _step(vg):
    def step(state, batch):
        def loss_fn(p):
            return mse_loss(state.apply_fn(p, batch["x"]), batch["y"])
        loss, grads = vg(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, grads
    return step


@pytest.mark.parametrize("method", [autopar.DataParallel(num_microbatches=4),
                                    autopar.Zero2Parallel(num_microbatches=2)])
def test_accumulation_reduces_gradients_once_per_step(method):
    state, batch = _mlp_state()
    par = autopar.parallelize(_step(autopar.value_and_grad), mesh=mesh_of((2, 4)),
                              method=method)
    program = par.get_compiled(state, batch)
    got = par(state, batch)
    stage = program.stages[0]
    n = len(jax.tree_util.tree_leaves(state.params))
    assert stage.local_grads == n
    assert f"{n} of {n} parameter gradients accumulate as per-device partial sums, reduced " \
        "once per step" in autopar.dump(par.get_plan(state, batch))
    # One executable: the microbatches are a loop whose body reduces only its loss (a
    # scalar), no gradient; the gradients are reduced once, after the loop.
    args = abstract_args(jax.tree_util.tree_leaves((state, batch)), program.in_shardings)
    hlo = program.whole_step.lower(*args).compile().as_text()
    per_microbatch = summary(loop_body_collectives(hlo))
    assert per_microbatch and per_microbatch.get("all-reduce", (0, 0))[1] <= 8, per_microbatch
    assert set(per_microbatch) == {"all-reduce"}, per_microbatch
    whole = summary(collectives(hlo))
    params = sum(x.size * 4 for x in jax.tree_util.tree_leaves(state.params))
    once = {k: (n - per_microbatch.get(k, (0, 0))[0], b - per_microbatch.get(k, (0, 0))[1])
            for k, (n, b) in whole.items()}
    assert once["all-reduce"][1] + once.get("reduce-scatter", (0, 0))[1] >= params, whole
    ref = jax.jit(_step(jax.value_and_grad))(state, batch)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(ref[2]), jax.tree_util.tree_leaves(got[2])):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.abs(a).max()))


def test_pipeline_stages_accumulate_locally():
    state, batch = _mlp_state(layers=4)
    method = two_stages_2x2(num_microbatches=4, batch_axis="data")
    par = autopar.parallelize(_step(autopar.value_and_grad), mesh=mesh_of((2, 4)),
                              method=method)
    program = par.get_compiled(state, batch)
    assert [st.local_grads for st in program.stages] == [
        len(st.slice.param_inputs) for st in program.stages]
    for _ in range(2):
        got = par(state, batch)
    ref = jax.jit(_step(jax.value_and_grad))(state, batch)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(ref[2]), jax.tree_util.tree_leaves(got[2])):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.abs(a).max()))


def test_an_unlabelled_partner_operand_is_split_with_the_batch():
    """x.T @ c, c a batch-sized value computed from constants (no batch dimension of its own):
    both contracted operands must be split alike inside the shard_map."""
    x = jnp.ones((8, 3))
    g, local = _local(lambda w, x: (x.T @ jnp.ones((8, 4)),), jnp.ones((3, 4)), x)
    (node,) = local.reducers
    assert local.split_dims[node] == (1, 0)          # x.T carries the batch on dim 1


def _embedding_grad_locals(ids_axes, rows_axes):
    """find_local_grads of an embedding gradient (a scatter of per-token rows into zeros) with
    the token ids' batch split over `ids_axes` and float batch values over `rows_axes`."""
    w, ids = jnp.ones((16, 4)), jnp.zeros((8, 3), jnp.int32)
    g = trace(lambda w, ids: jax.grad(lambda w: jnp.sum(w[ids] ** 2))(w), (w, ids),
              batch_argnums=(1,))
    dims = batch_dims(g)

    def spec_of(t):
        if dims[t] is None:
            return None
        axes = ids_axes if g.tensors[t].dtype.startswith("int") else rows_axes
        return tuple(axes if d == dims[t] else () for d in range(g.tensors[t].rank))
    (scatter,) = [n for n in g.nodes if n.primitive == "scatter-add"]
    return scatter, find_local_grads(g, spec_of, dims, g.outputs)


def test_nested_batch_splits_keep_the_finest_partials():
    """Token ids split over axis 0 and the rows scattered over axes 0 and 1 (a plan the ILP
    makes for a GPT's embedding): the scatter keeps partial sums over both, the ids sliced on
    each device; splits over unrelated axes keep the per-microbatch reduction."""
    scatter, local = _embedding_grad_locals((0,), (0, 1))
    assert local.reducers == {scatter.id: (0, 1)} and local.grad_outputs == (True,)
    scatter, local = _embedding_grad_locals((1,), (0,))
    assert not local and local.grad_outputs == (False,)
