"""Results follow the caller (issue 26): on an Explicit mesh with no `jax.set_mesh`, a step
hands back plain (Auto) arrays that mix with the caller's eager code as `jax.jit`'s do; under
`jax.set_mesh` they keep the mesh's axis types. The Flax Gemma example's shape: an NNX
split/merge step that updates an `nnx.MultiMetric`, then eager metrics and an evaluation after
every step."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import autopar
from autopar.models.gemma import Gemma, GemmaConfig, gemma_loss, make_gemma_batch

CFG = GemmaConfig()
MESH = jax.make_mesh((2, 4), ("data", "model"))          # Explicit axes, as users get them


def _objects(dtype):
    model = Gemma(CFG, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), params))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    return model, optimizer, nnx.MultiMetric(loss=nnx.metrics.Average("loss"))


def train_step(graphdef, state, batch):
    model, optimizer, metrics = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(gemma_loss)(model, batch)
    optimizer.update(model, grads)
    metrics.update(loss=loss)
    return nnx.split((model, optimizer, metrics))[1]


def _train(step, dtype):
    """Three steps, each followed by eager metrics and an evaluation on one device (as the
    Flax example's loop does): the recorded numbers and the last state."""
    objects = _objects(dtype)
    graphdef, state = nnx.split(objects)
    seen = []
    for i in range(3):
        batch = make_gemma_batch(jax.random.key(i), 16, CFG)
        state = step(graphdef, state, batch)
        nnx.update(objects, state)
        seen.append(float(objects[2].compute()["loss"]))
        objects[2].update(loss=jax.jit(gemma_loss)(objects[0], batch))
        seen.append(float(objects[2].compute()["loss"]))
        objects[2].reset()
    return np.array(seen), state


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("under_mesh", [False, True], ids=["plain", "set_mesh"])
def test_eager_metrics_after_each_step_as_under_jit(dtype, under_mesh):
    want, _ = _train(jax.jit(train_step, static_argnums=(0,)), dtype)
    par = autopar.parallelize(train_step, mesh=MESH, static_argnums=(0,), batch_argnums=(2,),
                              plan_cache=False)
    if under_mesh:
        with jax.set_mesh(MESH):
            got, state = _train(par, dtype)
    else:
        got, state = _train(par, dtype)
    rtol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=rtol)
    kinds = {x.sharding.mesh.axis_types for x in jax.tree_util.tree_leaves(state)}
    assert kinds == {(AxisType.Explicit,) * 2 if under_mesh else (AxisType.Auto,) * 2}
