"""Non-array leaves of traced arguments are static, as `eqx.filter_jit` takes them
(`frontend.static_leaves`): the arrays are traced, the rest is part of the cache key and
comes back in place."""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import autopar
from autopar.frontend.static_leaves import WithStatic, combined, holds_static, with_static
from support.steps import mesh_of


def test_a_tree_jax_jit_takes_is_left_as_it_is():
    tree = {"w": jnp.ones(3), "lr": 0.1, "step": 3, "flag": True, "none": None}
    assert not holds_static(tree)
    assert with_static(tree) is tree          # numbers stay traced, as under jax.jit


def test_an_equinox_module_keeps_its_arrays_traced_and_the_rest_static():
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    part = with_static(model)
    assert isinstance(part, WithStatic)
    leaves = jax.tree_util.tree_leaves(part)
    assert leaves and all(isinstance(x, jax.Array) for x in leaves)
    assert len(leaves) == len(jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))
    back = combined(part)
    assert back.activation is model.activation
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(back),
                                      jax.tree_util.tree_leaves(model)))
    # the leaf paths stay readable (dumps, errors, sharding rules)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(part)[0]]
    assert paths[0].endswith(".layers[0].weight"), paths[:2]
    # a float and a bool inside an Equinox module are static too (Dropout branches on them)
    drop = with_static(eqx.nn.Dropout(0.0))
    assert jax.tree_util.tree_leaves(drop) == []
    assert combined(drop).p == 0.0


def test_static_leaves_key_by_equality_else_identity():
    def key(tree):
        return jax.tree_util.tree_structure(with_static(tree))
    assert key({"f": jnp.tanh, "x": jnp.ones(2)}) == key({"f": jnp.tanh, "x": jnp.zeros(2)})
    assert key({"f": jnp.tanh, "x": jnp.ones(2)}) != key({"f": jnp.sin, "x": jnp.ones(2)})
    assert key({"s": "a", "x": jnp.ones(2)}) != key({"s": "b", "x": jnp.ones(2)})
    assert key({"s": 1, "o": "x"}) != key({"s": 1.0, "o": "x"})     # 1 == 1.0, other types
    class Box:                  # an object with __eq__ and no __hash__: keyed by identity
        __hash__ = None

        def __eq__(self, other):
            return True
    a, b = Box(), Box()
    assert key({"o": a}) == key({"o": a}) and key({"o": a}) != key({"o": b})


def test_a_step_gets_its_static_leaves_and_returns_them():
    calls = []

    def step(state, batch):
        calls.append(state["name"])       # traced once: the static value is a Python str
        new = {"w": state["w"] - 0.1 * jnp.mean(batch["x"]), "name": state["name"] + "!",
               "fn": state["fn"]}
        return new, state["fn"](jnp.sum(batch["x"] * state["w"][0]))

    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=False)
    state = {"w": jnp.ones(4), "name": "run", "fn": jnp.tanh}
    batch = {"x": jnp.arange(16.0).reshape(8, 2)}
    new, out = par(state, batch)
    assert new["name"] == "run!" and new["fn"] is jnp.tanh
    par({**state, "w": new["w"]}, batch)          # the same static values: no new trace
    assert calls == ["run"]
    par({**state, "name": "other"}, batch)        # another static value: planned again
    assert calls == ["run", "other"]
    want_new, want_out = eqx.filter_jit(step)(state, batch)
    np.testing.assert_allclose(new["w"], want_new["w"], rtol=1e-6)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
