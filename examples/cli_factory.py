"""A tiny step for `autopar plan`: a 4-layer MLP trained with Adam, as abstract arguments.

`autopar plan MODULE:FACTORY` imports MODULE (a dotted module or a .py file), calls FACTORY()
and plans what it returns: `(step, args)` or `(step, args, plan_kwargs)`. The arguments may be
abstract (`jax.ShapeDtypeStruct` trees from `jax.eval_shape`), so nothing is allocated and no
device of the target cluster is needed:

    python -m autopar plan examples/cli_factory.py:make_step --preset dgx-a100 --hosts 2
    python -m autopar plan examples/cli_factory.py:make_step --preset dgx-a100 --hosts 2 \\
        --method pipeshard --microbatches 4 -o pipe.json
    python -m autopar dump plan.json --format markdown

The step takes its gradient with `autopar.value_and_grad`, so it also plans as a pipeline
(`--method pipeshard`); under the other methods that is plain `jax.value_and_grad`.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import autopar

BATCH, IN_DIM, HIDDEN, LAYERS = 256, 1024, 2048, 4


class MLP(nn.Module):
    hidden: int
    num_layers: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.num_layers):
            x = nn.Dense(self.hidden)(x)
            if i < self.num_layers - 1:
                x = jax.nn.relu(x)
        return x


def create_state():
    model = MLP(HIDDEN, LAYERS)
    params = model.init(jax.random.key(0), jnp.ones((1, IN_DIM)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adam(1e-3))


def train_step(state, batch):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make_step():
    """(step, abstract args, keyword arguments for `autopar.plan`)."""
    state = jax.eval_shape(create_state)
    batch = {"x": jax.ShapeDtypeStruct((BATCH, IN_DIM), jnp.float32),
             "y": jax.ShapeDtypeStruct((BATCH, HIDDEN), jnp.float32)}
    return train_step, (state, batch), {"batch_argnums": (1,)}
