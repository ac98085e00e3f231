"""Tests for autopar.frontend.labels: NNX operators (no name scopes) labelled by the
parameter they consume, as the plan and the dump show them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import autopar


def test_nnx_operators_are_labelled_by_their_parameter():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear1 = nnx.Linear(16, 32, rngs=rngs)
            self.linear2 = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return self.linear2(nnx.relu(self.linear1(x)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Block(rngs), Block(rngs)])

        def __call__(self, x):
            for b in self.layers:
                x = b(x)
            return x

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: ((m(batch["x"]) - batch["y"]) ** 2).mean())(
            model)
        optimizer.update(model, grads)
        return loss
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    batch = {"x": jnp.ones((16, 16)), "y": jnp.ones((16, 16))}
    plan = autopar.parallelize(step, mesh=jax.make_mesh((2, 4), ("data", "model")),
                               batch_argnums=(2,), plan_cache=False
                               ).get_plan(model, optimizer, batch)
    labels = [o.name_stack for o in plan.operators]
    assert len(labels) == 11       # 4 forward, 4 weight- and 3 input-gradient matmuls
    assert all("@model.layers[" in s for s in labels), labels
    for layer in (0, 1):
        for lin in ("linear1", "linear2"):
            mine = [s for s in labels if s.endswith(f"@model.layers[{layer}].{lin}.kernel")]
            # forward, weight gradient, input gradient (none for the first: x needs none)
            assert len(mine) == (2 if (layer, lin) == (0, "linear1") else 3), labels
            assert sum(s.startswith("jvp()/") for s in mine) == 1
    text = autopar.dump(plan, full=True)
    assert "jvp()/Block@model.layers[1].linear2.kernel" in text
