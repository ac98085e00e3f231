"""jax.jit's argument options on parallelize (autopar/frontend/jit_options.py):
static_argnames / donate_argnames through the signature, in_shardings / out_shardings pinned
(the layout asked for, in `out.sharding` and the compiled executable, with jax.jit's
numbers), and clear errors for specs that cannot apply."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from support.nnx_models import microbatch_methods, mse_step


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def sgd_step(params, batch, lr):
    def loss(p):
        h = jnp.tanh(batch["x"] @ p["w1"])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda a, b: a - lr * b, params, grads), value


def make_inputs():
    k = jax.random.key(0)
    params = {"w1": jax.random.normal(k, (16, 32)),
              "w2": jax.random.normal(jax.random.fold_in(k, 1), (32, 6))}
    batch = {"x": jax.random.normal(jax.random.fold_in(k, 2), (32, 16)),
             "y": jax.random.normal(jax.random.fold_in(k, 3), (32, 6))}
    return params, batch


def same(sharding, mesh, spec, ndim) -> bool:
    return sharding.is_equivalent_to(NamedSharding(mesh, spec), ndim)


def test_pinned_shardings_are_kept_and_match_jax_jit(mesh):
    in_sh = ({"w1": P(None, "model"), "w2": None}, P("data"))
    out_sh = ({"w1": P("model", None), "w2": P()}, None)
    step = autopar.parallelize(sgd_step, mesh=mesh, static_argnames="lr",
                               donate_argnames="params", in_shardings=in_sh,
                               out_shardings=out_sh)
    ref = jax.jit(sgd_step, static_argnames="lr")
    p_ref, batch = make_inputs()
    p_par = jax.tree.map(jnp.copy, p_ref)
    for _ in range(3):
        p_ref, l_ref = ref(p_ref, batch, 0.1)
        p_par, l_par = step(p_par, batch, lr=0.1)        # static by keyword, too
        np.testing.assert_allclose(l_par, l_ref, rtol=1e-5)
    for name in ("w1", "w2"):
        np.testing.assert_allclose(p_par[name], p_ref[name], rtol=1e-5, atol=1e-5)
    assert same(p_par["w1"].sharding, mesh, P("model", None), 2)
    assert same(p_par["w2"].sharding, mesh, P(), 2)
    # The compiled executable takes and gives those layouts (not a copy made afterwards).
    compiled = step.get_compiled(p_par, batch, 0.1)
    ins = jax.tree_util.tree_leaves(compiled.input_shardings)
    outs = jax.tree_util.tree_leaves(compiled.output_shardings)
    assert same(ins[0], mesh, P(None, "model"), 2)           # params['w1']
    assert same(ins[2], mesh, P("data"), 2) and same(ins[3], mesh, P("data"), 2)   # batch
    assert same(outs[0], mesh, P("model", None), 2) and same(outs[1], mesh, P(), 2)
    graph = step.get_graph(p_par, batch, 0.1)
    assert graph.donated_inputs == frozenset({0, 1})          # params, by name
    assert compiled.memory_analysis().alias_size_in_bytes >= 32 * 6 * 4   # w2 in place
    old = p_par
    p_par, _ = step(p_par, batch, 0.1)
    assert old["w2"].is_deleted() and not batch["x"].is_deleted()


def test_named_sharding_and_nnx_step(mesh):
    def objects():
        model = nnx.Linear(16, 6, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    ref, par = objects(), objects()
    batch = make_inputs()[1]
    step = autopar.parallelize(mse_step, mesh=mesh, batch_argnums=(2,),
                               in_shardings=(None, None, NamedSharding(mesh, P("data"))),
                               out_shardings=NamedSharding(mesh, P()))
    for _ in range(3):
        loss = step(*par, batch)
        np.testing.assert_allclose(loss, nnx.jit(mse_step)(*ref, batch), rtol=1e-5)
    assert same(loss.sharding, mesh, P(), 0)
    np.testing.assert_allclose(par[0].kernel[...], ref[0].kernel[...], rtol=1e-5, atol=1e-6)
    assert all(same(s, mesh, P("data"), 2)
               for s in jax.tree_util.tree_leaves(step.input_shardings(*par, batch)[2]))


def test_argnames_errors(mesh):
    with pytest.raises(autopar.InvalidArgumentError, match=r"no positional parameter 'rate'"):
        autopar.parallelize(sgd_step, mesh=mesh, static_argnames="rate")
    with pytest.raises(autopar.InvalidArgumentError, match=r"donate_argnames.*'state'"):
        autopar.parallelize(sgd_step, mesh=mesh, donate_argnames=("state",))


@pytest.mark.parametrize("in_sh, message", [
    (({"w1": P("data", "data"), "w2": None}, None), r"argument 0 \(`params`\), leaf "
     r"`params\['w1'\]`.*uses axis 'data' twice"),
    ((None, P("data", "model")), r"argument 1 \(`batch`\), leaf `batch\['y'\]` of shape "
     r"\(32, 6\).*dimension 1 \(size 6\) over 4 devices"),
    ((None, P("rows")), r"argument 1 \(`batch`\), leaf `batch\['x'\]`.*axis 'rows'; the mesh "
     r"axes are \('data', 'model'\)"),
    (({"w1": P()}, None), r"argument 0 \(`params`\) is not a pytree prefix of the value: at "
     r"`params` the prefix has a dict with keys \[\"\['w1'\]\"\] but the value a dict with keys "
     r"\[\"\['w1'\]\", \"\['w2'\]\"\]"),
    ((P("data"),), r"one entry per non-static positional argument \(2 here"),
    ((None, NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))), r"argument 1 \(`batch`\), "
     r"leaf `batch\['x'\]`: NamedSharding on mesh \{'x': 8\}.*not on the step's mesh"),
])
def test_bad_in_shardings_name_argument_and_leaf(mesh, in_sh, message):
    step = autopar.parallelize(sgd_step, mesh=mesh, static_argnums=(2,), in_shardings=in_sh)
    with pytest.raises(autopar.InvalidArgumentError, match=message):
        step(*make_inputs(), 0.1)


def test_out_shardings_prefix_mismatch_names_the_result_path(mesh):
    step = autopar.parallelize(sgd_step, mesh=mesh, static_argnums=(2,),
                               out_shardings=({"w1": P()}, None))
    with pytest.raises(autopar.InvalidArgumentError, match=r"out_shardings is not a pytree prefix "
                                                           r"of the value: at `result\[0\]`"):
        step(*make_inputs(), 0.1)


def test_bad_out_shardings_name_result_leaf(mesh):
    step = autopar.parallelize(sgd_step, mesh=mesh, static_argnums=(2,),
                               out_shardings=({"w1": None, "w2": P("model")}, P("data")))
    with pytest.raises(autopar.InvalidArgumentError,
                       match=r"out_shardings, result leaf `result\[1\]` of shape \(\): .* 1 "
                             r"entries for 0 dimension"):
        step(*make_inputs(), 0.1)


@microbatch_methods(2)
def test_pinned_shardings_with_microbatches(mesh, method):
    def step_fn(params, batch):
        value, grads = autopar.value_and_grad(
            lambda p: jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2))(
            params)
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, grads), value

    step = autopar.parallelize(step_fn, mesh=mesh, method=method,
                               in_shardings=({"w1": P(None, "model"), "w2": None}, P("data")),
                               out_shardings=({"w1": P("model"), "w2": None}, P()))
    params, batch = make_inputs()
    ref = jax.jit(step_fn)(params, batch)
    got = step(params, batch)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    np.testing.assert_allclose(got[0]["w1"], ref[0]["w1"], rtol=1e-5, atol=1e-6)
    assert same(got[0]["w1"].sharding, mesh, P("model"), 2) and same(got[1].sharding, mesh, P(), 0)
    shardings = step.input_shardings(params, batch)
    assert shardings[0]["w1"].spec == P(None, "model") and shardings[1]["x"].spec[0] == "data"
