"""NNX graph objects as arguments of a parallelized step (autopar/frontend/nnx.py): the step
written for `nnx.jit` runs unchanged under `autopar.parallelize` on a 2x4 mesh and updates
its NNX arguments in place as `nnx.jit` on one device does (3 steps, fp32: to 1e-5 where the
model is smooth, by the routing rule of tests/support/equivalence.py where it has ReLUs)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autopar
from autopar.core.graph import InputRole
from autopar.models.gemma import Gemma, GemmaConfig, make_gemma_batch, nnx_train_step
from support.equivalence import assert_losses_close
from support.nnx_models import (
    MESH_SHAPE,
    BnDropNet,
    assert_same_metrics,
    assert_same_state,
    mnist_batches,
    mnist_objects,
    mnist_train_step,
    mse,
    mse_step,
    one_device_memory,
    regression_batches,
)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh(MESH_SHAPE, ("data", "model"))


# --- the MNIST tutorial step ------------------------------------------------------------


def test_mnist_tutorial_step_matches_nnx_jit(mesh):
    ref, par = mnist_objects(), mnist_objects()
    ref_step = nnx.jit(mnist_train_step)
    step = autopar.parallelize(mnist_train_step, mesh=mesh, batch_argnums=(3,))
    for batch in mnist_batches():
        assert ref_step(*ref, batch) is None
        assert step(*par, batch) is None
    assert int(par[1].step[...]) == int(ref[1].step[...]) == 3
    # A ReLU CNN after 3 steps: by the routing rule of tests/support/equivalence.py.
    assert_same_metrics(ref[2], par[2])
    for r, p in zip(ref, par):
        assert_same_state(r, p, steps=3, smooth=False)
    # The state lives on the mesh afterwards, where the plan put it.
    assert par[0].linear1.kernel[...].sharding.mesh.devices.shape == MESH_SHAPE


def test_mnist_plan_paths_roles_and_donation(mesh):
    model, optimizer, metrics = mnist_objects()
    batch = mnist_batches(1)[0]
    step = autopar.parallelize(mnist_train_step, mesh=mesh, batch_argnums=(3,))
    graph = step.get_graph(model, optimizer, metrics, batch)
    role = {graph.tensors[t].path: graph.tensors[t].role for t in graph.inputs}
    assert role["model.linear1.kernel"] == InputRole.PARAM
    assert role["optimizer.opt_state[0].mu.linear1.kernel"] == InputRole.OPT_STATE
    assert role["optimizer.opt_state[0].nu.conv1.bias"] == InputRole.OPT_STATE
    assert role["optimizer.step"] == InputRole.OTHER
    assert role["batch['image']"] == InputRole.BATCH
    assert "model.linear1.kernel" in autopar.dump(step.get_plan(model, optimizer, metrics, batch))
    # The NNX states are donated without being asked: every state byte is aliased.
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(
        nnx.state((model, optimizer, metrics))))
    donated = [graph.tensors[graph.inputs[i]].path for i in sorted(graph.donated_inputs)]
    assert len(donated) == len(jax.tree_util.tree_leaves(nnx.state((model, optimizer,
                                                                    metrics))))
    memory = step.get_compiled(model, optimizer, metrics, batch).memory_analysis()
    assert memory.alias_size_in_bytes > 0
    assert memory.alias_size_in_bytes <= state_bytes
    # input_shardings: an nnx.State per NNX argument, shaped like nnx.state(arg).
    shardings = step.input_shardings(model, optimizer, metrics, batch)
    assert jax.tree_util.tree_structure(shardings[0]) == jax.tree_util.tree_structure(
        nnx.state(model))
    assert isinstance(shardings[0]["linear1"]["kernel"].get_value(), jax.sharding.NamedSharding)
    assert shardings[3]["image"].mesh.devices.shape == MESH_SHAPE


def test_wrong_batch_argnums_names_the_nnx_argument(mesh):
    step = autopar.parallelize(mnist_train_step, mesh=mesh)      # default batch_argnums=(1,)
    with pytest.raises(autopar.InvalidArgumentError,
                       match=r"argument 1 \(`optimizer`\).*Optimizer.*batch_argnums=\(3,\)"):
        step(*mnist_objects(), mnist_batches(1)[0])


# --- a Gemma-like model -------------------------------------------------------------------

def test_gemma_like_step_matches_nnx_jit_and_memory(mesh):
    cfg = GemmaConfig()

    def objects():
        model = Gemma(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    batches = [make_gemma_batch(jax.random.key(i), 16, cfg) for i in range(3)]
    ref, par = objects(), objects()
    ref_step = nnx.jit(nnx_train_step)
    step = autopar.parallelize(nnx_train_step, mesh=mesh, batch_argnums=(2,))
    for batch in batches:
        np.testing.assert_allclose(step(*par, batch), ref_step(*ref, batch), rtol=1e-5)
    assert int(par[1].step[...]) == 3
    assert_same_state(ref[0], par[0], steps=3, smooth=True)        # GELU, softmax: smooth
    assert_same_state(ref[1], par[1], steps=3, smooth=True)
    # Temp memory per device on 2x4 is well under half of one device's.
    one = one_device_memory(nnx_train_step, objects(), batches[0])
    got = step.get_compiled(*par, batches[0]).memory_analysis()
    assert got.temp_size_in_bytes <= 0.5 * one.temp_size_in_bytes, (
        got.temp_size_in_bytes, one.temp_size_in_bytes)


# --- BatchNorm statistics, Dropout RNG counters -------------------------------------------


def test_batchnorm_stats_and_dropout_rng_match_nnx_jit(mesh):
    def objects():
        model = BnDropNet(nnx.Rngs(0, dropout=1))
        return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

    ref, par = objects(), objects()
    mean0 = np.asarray(par[0].bn.mean[...])
    ref_step = nnx.jit(mse_step)
    step = autopar.parallelize(mse_step, mesh=mesh, batch_argnums=(2,))
    got, want = [], []
    for batch in regression_batches():
        got.append(step(*par, batch))
        want.append(ref_step(*ref, batch))
    assert int(par[0].drop.rngs.count[...]) == 3          # the dropout stream advanced
    assert not np.allclose(par[0].bn.mean[...], mean0)    # the statistics moved
    # ...as under nnx.jit: a ReLU net after 3 steps, by the routing rule of equivalence.py
    assert_losses_close(want, got, smooth=False)
    assert_same_state(ref[0], par[0], steps=3, smooth=False)
    assert_same_state(ref[1], par[1], steps=3, smooth=False)


# --- shared objects, graph changes, mutations that cannot be written back ---------------

def test_shared_module_keeps_identity(mesh):
    def objects():
        model = BnDropNet(nnx.Rngs(0, dropout=1))
        # optimizer.model is model. Adam's eps is raised: with eps=1e-8 it turns the float
        # reassociation noise of a near-zero gradient (a different, equally good sharding)
        # into steps of +-lr, which the comparison cannot tell from a wrong answer.
        return model, nnx.ModelAndOptimizer(model, optax.adam(1e-2, eps=1e-3))

    def step_fn(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(
            lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        optimizer.update(grads)
        return loss

    ref, par = objects(), objects()
    kernel = par[0].l1.kernel
    step = autopar.parallelize(step_fn, mesh=mesh, batch_argnums=(2,))
    graph = step.get_graph(*par, regression_batches(1)[0])
    paths = [graph.tensors[t].path for t in graph.inputs]
    assert "model.l1.kernel" in paths and not any(p.startswith("optimizer.model") for p in paths)
    for batch in regression_batches():
        nnx.jit(step_fn)(*ref, batch)
        step(*par, batch)
    assert par[1].model is par[0] and par[0].l1.kernel is kernel
    assert_same_state(ref[0], par[0], steps=3, smooth=False)      # ReLU: routing
    assert_same_state(ref[1], par[1], steps=3, smooth=False)


def test_variable_and_rngs_arguments(mesh):
    def step_fn(counter, rngs, batch):
        counter[...] += 1
        return jnp.mean(batch["x"] + jax.random.normal(rngs.noise(), batch["x"].shape))

    batch = regression_batches(1)[0]
    ref = (nnx.Variable(jnp.zeros((), jnp.int32)), nnx.Rngs(noise=3))
    par = (nnx.Variable(jnp.zeros((), jnp.int32)), nnx.Rngs(noise=3))
    step = autopar.parallelize(step_fn, mesh=mesh, batch_argnums=(2,))
    for _ in range(3):
        np.testing.assert_allclose(step(*par, batch), nnx.jit(step_fn)(*ref, batch), rtol=1e-5)
    assert int(par[0][...]) == 3 and int(par[1].noise.count[...]) == 3
    assert isinstance(step.input_shardings(*par, batch)[0].get_value(),
                      jax.sharding.NamedSharding)


def test_functional_nnx_state_stays_a_pytree(mesh):
    """`nnx.split(model, nnx.Param)`'s State (Variables in a pytree) is taken and returned as
    a pytree, as before: functional NNX code is not an in-place NNX call."""
    graphdef, params = nnx.split(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), nnx.Param)

    def step_fn(params, batch):
        loss, grads = jax.value_and_grad(lambda p: mse(nnx.merge(graphdef, p), batch))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    batch = regression_batches(1)[0]
    (new, loss), (ref, ref_loss) = (autopar.parallelize(step_fn, mesh=mesh)(params, batch),
                                    jax.jit(step_fn)(params, batch))
    assert isinstance(new, nnx.State) and jax.tree_util.tree_structure(new) == \
        jax.tree_util.tree_structure(ref)
    np.testing.assert_allclose(new["kernel"][...], ref["kernel"][...], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


def test_graph_structure_change_is_written_back_as_nnx_jit_does(mesh):
    def step_fn(model, batch):
        model.seen = nnx.Variable(jnp.sum(batch["x"]))    # a new Variable
        model.tag = "trained"                              # a new static attribute
        return jnp.mean(model(batch["x"]))

    ref, par = nnx.Linear(8, 4, rngs=nnx.Rngs(0)), nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    step, ref_step = autopar.parallelize(step_fn, mesh=mesh), nnx.jit(step_fn)
    for batch in regression_batches(2):     # the second call has a new graph: planned anew
        np.testing.assert_allclose(step(par, batch), ref_step(ref, batch), rtol=1e-6)
        assert par.tag == ref.tag == "trained"
        np.testing.assert_allclose(par.seen[...], ref.seen[...], rtol=1e-6)
    fresh = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    assert step.get_plan(fresh, batch).graph_fingerprint != \
        step.get_plan(par, batch).graph_fingerprint


def test_array_outside_a_variable_raises(mesh):
    def step_fn(model, batch):
        model.last_loss = jnp.mean(model(batch["x"]))      # not a Variable: cannot go back
        return model.last_loss

    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    step = autopar.parallelize(step_fn, mesh=mesh)
    with pytest.raises(autopar.UnsupportedError, match=r"`model\.last_loss`.*nnx\.Variable"):
        step(model, regression_batches(1)[0])
    assert not hasattr(model, "last_loss")


def test_returning_a_module_raises(mesh):
    step = autopar.parallelize(lambda model, batch: model, mesh=mesh)
    with pytest.raises(autopar.UnsupportedError, match="returns an NNX graph object"):
        step(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), regression_batches(1)[0])


def test_autopar_plan_takes_nnx_objects_as_parallelize_does():
    """`autopar.plan` binds NNX arguments as `parallelize` does: the model and optimizer are
    planned as their states, leaves named by attribute path."""
    cfg = GemmaConfig()
    model = Gemma(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batch = make_gemma_batch(jax.random.key(1), 16, cfg)
    plan = autopar.plan(nnx_train_step, model, optimizer, batch,
                        cluster=autopar.ClusterSpec.preset("cpu"), mesh_shape=(2, 4),
                        batch_argnums=(2,))
    paths = [t.path for t in plan.inputs]
    assert "model.embed.embedding" in paths and paths[-1] == "batch['tokens']", paths[-3:]
    n_state = len(jax.tree_util.tree_leaves(nnx.state((model, optimizer))))
    assert len(paths) == n_state + 1
