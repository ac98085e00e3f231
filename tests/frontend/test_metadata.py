"""Parameters' sharding metadata as pins (autopar/frontend/metadata.py): NNX
`with_partitioning` and linen logical partitioning boxes; the numbers equal jax.jit's."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import autopar
from support.equivalence import assert_losses_close, assert_params_close

KERNEL = ((), (1,))          # (None, 'model') on a (data, model) mesh


class Mlp(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, (None, "model")),
                             rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_init=nnx.with_partitioning(init, ("model", None)),
                               rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def _nnx_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def _x(i):
    return jnp.asarray(np.random.RandomState(i).randn(16, 16), jnp.float32)


def test_nnx_partitioning_metadata_pins_params_and_matches_nnx_jit():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    step = autopar.parallelize(_nnx_step, mesh=mesh, batch_argnums=(2,), plan_cache=False)
    with jax.set_mesh(mesh):       # eager sharding: the Variables are made on the mesh
        ref_model, got_model = Mlp(nnx.Rngs(0)), Mlp(nnx.Rngs(0))
        ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
        got_opt = nnx.Optimizer(got_model, optax.adam(1e-2), wrt=nnx.Param)
        want, got = [], []
        for i in range(3):
            want.append(nnx.jit(_nnx_step)(ref_model, ref_opt, _x(i)))
            got.append(step(got_model, got_opt, _x(i)))
    # A ReLU MLP trained 3 steps: by the routing rule of tests/support/equivalence.py.
    assert_losses_close(want, got, smooth=False)
    assert_params_close(np.asarray(ref_model.up.kernel[...]),
                        np.asarray(got_model.up.kernel[...]), steps=3, smooth=False)
    plan = step.get_plan(got_model, got_opt, _x(0))
    spec = {t.path: t.spec for t in plan.inputs}
    assert spec["model.up.kernel"] == KERNEL
    assert spec["model.down.kernel"] == ((1,), ())
    # The optimizer's moments carry their parameter's metadata: pinned alike.
    moments = [p for p in spec if p.startswith("optimizer") and p.endswith("up.kernel")]
    assert moments and all(spec[p] == KERNEL for p in moments)
    # annotations="ignore" plans without them (the ILP alone keeps this small MLP whole).
    free = autopar.parallelize(_nnx_step, mesh=mesh, batch_argnums=(2,), plan_cache=False,
                               method=autopar.ShardParallel(annotations="ignore"))
    free_spec = {t.path: t.spec for t in free.get_plan(got_model, got_opt, _x(0)).inputs}
    assert free_spec["model.up.kernel"] != KERNEL


class LogicalMlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        return nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(
            jax.nn.relu(h))


def test_linen_logical_partitioning_boxes_are_pinned_under_the_rules():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = (("embed", None), ("mlp", "model"))
    model = LogicalMlp()
    state = train_state.TrainState.create(apply_fn=model.apply,
                                          params=model.init(jax.random.key(0), _x(0)),
                                          tx=optax.sgd(0.1))

    def step(state, x):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((state.apply_fn(p, x) - x) ** 2))(state.params)
        return state.apply_gradients(grads=grads), loss

    par = autopar.parallelize(step, mesh=mesh, plan_cache=False)
    ref_state, got_state = state, state
    want, got = [], []
    with nn.logical_axis_rules(rules):
        for i in range(3):
            ref_state, loss = jax.jit(step)(ref_state, _x(i))
            want.append(loss)
            got_state, loss = par(got_state, _x(i))
            got.append(loss)
        plan = par.get_plan(state, _x(0))
    assert_losses_close(want, got, smooth=False)      # a ReLU MLP: step 2 by the routing rule
    spec = {t.path: t.spec for t in plan.inputs}
    kernels = {p: s for p, s in spec.items() if p.startswith("state.params") and "kernel" in p}
    assert sorted(kernels.values()) == sorted([KERNEL, ((1,), ())]), kernels


def test_metadata_that_does_not_fit_the_mesh_is_not_pinned():
    from autopar.frontend.metadata import metadata_rules
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tree = {"fits": nn.Partitioned(jnp.ones((3, 8)), names=(None, "model")),
            "does_not_divide": nn.Partitioned(jnp.ones((3, 6)), names=(None, "model")),
            "unknown_axis": nn.Partitioned(jnp.ones((3, 8)), names=(None, "tensor"))}
    rules = metadata_rules((tree,), (), ("p",), mesh)
    assert [(pattern, entries) for pattern, entries in rules] == [
        (r"^p\['fits'\]\.value$", (None, "model"))]
