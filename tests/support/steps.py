"""Train steps the way users write them (flax linen TrainState, Flax NNX split/merge), shared
by the tests. Each step returns (new_state, loss, grads) so tests can compare gradients."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import autopar
from autopar.models.gpt import GPT, GPTConfig, NnxGPT, gpt_loss, make_gpt_batch
from autopar.models.lm1b import Lm1bConfig, Lm1bTransformer, make_lm1b_batch
from autopar.models.mlp import MLP, NnxMLP, make_mlp_batch, mse_loss
from support.equivalence import assert_equivalent, params_of  # noqa: F401  (the tests' comparison rule)

TINY_GPT = GPTConfig(vocab_size=128, seq_len=16, num_layers=2, hidden=32, num_heads=4)


def sgd_momentum_clip():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.9))


@functools.lru_cache(maxsize=32)
def _model_and_batches(model: str, api: str, batch_size: int, num_layers: int, hidden: int,
                       seed: int, gpt_config: GPTConfig):
    """(net, its initial parameters, batches, apply_loss, inputs) of a `make_case`, made once
    per process: initializing a model runs op by op (seconds for the NNX GPT), and the suite
    builds the same few cases hundreds of times. Callers get fresh copies of the arrays."""
    key = jax.random.key(seed)
    if model == "mlp":
        batches = [make_mlp_batch(jax.random.fold_in(key, i), batch_size, hidden, hidden)
                   for i in range(3)]
        apply_loss = lambda out, b: mse_loss(out, b["y"])
        inputs = lambda b: b["x"]
        if api == "linen":
            net = MLP(num_layers=num_layers, hidden=hidden)
        else:
            net = NnxMLP(num_layers, hidden, hidden, rngs=nnx.Rngs(seed))
    else:
        batches = [make_gpt_batch(jax.random.fold_in(key, i), batch_size, gpt_config)
                   for i in range(3)]
        apply_loss = lambda out, b: gpt_loss(out, b["tokens"])
        inputs = lambda b: b["tokens"]
        net = GPT(gpt_config) if api == "linen" else NnxGPT(gpt_config, rngs=nnx.Rngs(seed))
    if api == "linen":
        return net, net.init(key, inputs(batches[0])), batches, apply_loss, inputs
    graphdef, params = nnx.split(net, nnx.Param)
    return graphdef, params, batches, apply_loss, inputs


def make_case(model: str, api: str, tx, *, batch_size=16, num_layers=2, hidden=32, seed=0,
              value_and_grad=jax.value_and_grad, gpt_config=TINY_GPT):
    """Returns (step, state, batches): `step(state, batch) -> (state, loss, grads)`; pass
    `value_and_grad=autopar.value_and_grad` for pipeline plans. The arrays are the caller's
    own (copies), so a step may donate them."""
    net, params, batches, apply_loss, inputs = _model_and_batches(
        model, api, batch_size, num_layers, hidden, seed, gpt_config)
    params, batches = jax.tree_util.tree_map(jnp.copy, (params, batches))

    if api == "linen":
        state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)

        def step(state, batch):
            def loss_fn(p):
                return apply_loss(state.apply_fn(p, inputs(batch)), batch)
            loss, grads = value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), loss, grads
        return step, state, batches

    graphdef = net

    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            return apply_loss(nnx.merge(graphdef, p)(inputs(batch)), batch)
        loss, grads = value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss, grads
    return step, (params, tx.init(params)), batches


def mlp_train_state(in_dim: int, hidden: int, tx, num_layers: int = 2):
    """A linen MLP TrainState (params under 'params'); use with `mlp_train_step`."""
    model = MLP(num_layers=num_layers, hidden=hidden)
    params = model.init(jax.random.key(0), jnp.ones((1, in_dim)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def mlp_adam_state(hidden: int, num_layers: int, batch_size: int):
    """(TrainState with Adam, batch) of a linen MLP whose params are the whole init tree."""
    net = MLP(num_layers=num_layers, hidden=hidden)
    batch = make_mlp_batch(jax.random.key(1), batch_size, hidden, hidden)
    state = train_state.TrainState.create(
        apply_fn=net.apply, params=net.init(jax.random.key(0), batch["x"]),
        tx=optax.adam(1e-3))
    return state, batch


def mlp_train_step(state, batch):
    def loss_fn(params):
        return mse_loss(state.apply_fn({"params": params}, batch["x"]), batch["y"])
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def run_steps(step, state, batches):
    losses, grads = [], []
    for b in batches:
        state, loss, g = step(state, b)
        losses.append(np.asarray(loss))
        grads.append(jax.tree_util.tree_map(np.asarray, g))
    return state, losses, grads


def mesh_of(shape):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:n])


def two_stages_2x2(**kw) -> autopar.PipeshardParallel:
    """A 2-stage pipeline of 2 layers on the 2x4 mesh, each stage on a (1, 4) submesh seen as
    a (2, 2) logical mesh, 2 microbatches unless `kw` says otherwise."""
    return autopar.PipeshardParallel(**{
        "num_microbatches": 2, "layer_option": autopar.AutoLayerOption(num_layers=2),
        "stage_option": autopar.ManualStageOption(layer_spans=((0, 0), (1, 1)),
                                                  submesh_shapes=((1, 4), (1, 4)),
                                                  logical_shapes=((2, 2), (2, 2))), **kw})


def init_params(model, x):
    """`model.init(...)["params"]` for input `x`, jitted with an RBG key (fast on CPU)."""
    return jax.jit(model.init)(jax.random.key(1, impl="unsafe_rbg"), x)["params"]


def num_params(tree) -> int:
    """Elements in all leaves of a parameter tree."""
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))


# Four 16 x 16 layers and a batch of 8: the small marked-MLP data of the pipeline unit tests.
H, B = 16, 8
KEY = jax.random.key(0)
PARAMS = {f"l{i}": jax.random.normal(jax.random.fold_in(KEY, i), (H, H)) * 0.3
          for i in range(4)}
BATCH = {"x": jax.random.normal(jax.random.fold_in(KEY, 10), (B, H)),
         "y": jax.random.normal(jax.random.fold_in(KEY, 11), (B, H))}


def marked_layers(p, x):
    """tanh(x @ l0) ... tanh(. @ l3), with a stage boundary after each of the first three."""
    h = x
    for i in range(4):
        h = jnp.tanh(h @ p[f"l{i}"])
        if i < 3:
            h = autopar.mark_stage_boundary(h)
    return h


# An activation-heavy LM (a long sequence, a small width): what rematerialization is for.
LONG_LM = GPTConfig(vocab_size=64, seq_len=128, num_layers=2, hidden=32, num_heads=2)


def long_lm_case():
    """(step, state, batches, jax.jit's results over them) of `LONG_LM` with
    `autopar.value_and_grad` and SGD with momentum and clipping."""
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(), batch_size=16,
                                     value_and_grad=autopar.value_and_grad, gpt_config=LONG_LM)
    return step, state, batches, run_steps(jax.jit(step), state, batches)


def run_under_memory_scheduler(script: str, timeout_s: float = 900):
    """Run `script` (Python source whose last line of output is JSON) in a fresh process whose
    XLA:CPU schedules for memory (`--xla_cpu_enable_concurrency_optimized_scheduler=false`,
    as GPU/TPU do; the flag is process-wide, hence the process), with this repository and
    tests/ importable and the plan cache off; returns the parsed JSON."""
    import json
    import os
    import subprocess
    import sys

    from support import REPO as root
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]),
               XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                         "--xla_cpu_enable_concurrency_optimized_scheduler=false",
               JAX_PLATFORMS="cpu", AUTOPAR_PLAN_CACHE="off")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


LM1B = Lm1bConfig()                       # vocab 64, seq 16, hidden 32, 2 layers
# Tokens per example in each step's batch: uneven microbatches (microbatch m holds examples m
# and m + 4); in the last step examples 1 and 5 have no target, so microbatch 1 has none.
LM1B_LENGTHS = ([16, 3, 9, 12, 5, 16, 2, 7], [7, 16, 3, 9, 12, 5, 16, 2],
                [16, 1, 9, 12, 5, 1, 2, 7])


def lm1b_state_and_batches(tx):
    """(TrainState of `Lm1bTransformer(LM1B)` with `tx`, three padded token batches of 8)."""
    key = jax.random.key(0)
    batches = [make_lm1b_batch(jax.random.fold_in(key, i), 8, LM1B, lengths)
               for i, lengths in enumerate(LM1B_LENGTHS)]
    model = Lm1bTransformer(LM1B)
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(key, batches[0]["inputs"])["params"], tx=tx)
    return state, batches


def bert_mlm_case():
    """(step, (params, opt_state), batches): the 4-layer BERT MLM of `autopar.models.bert`
    (vocab 64, seq 16, hidden 32, 4 heads), batch 16, Adam, its loss taken with
    `autopar.value_and_grad`; the step returns (state, loss, grads)."""
    from autopar.models.bert import BertMLM, bert_batch, mlm_loss
    net = BertMLM(vocab=64, seq=16, hidden=32, heads=4, layers=4)
    batches = [bert_batch(16, 16, 64, seed=i) for i in range(3)]
    params = net.init(jax.random.key(0), batches[0]["tokens"], batches[0]["attention"])
    tx = optax.adam(1e-2)

    def step(state, batch):
        params, opt = state
        loss, grads = autopar.value_and_grad(lambda p: mlm_loss(
            net.apply(p, batch["tokens"], batch["attention"]), batch["labels"],
            batch["weights"]))(params)
        updates, opt = tx.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), loss, grads
    return step, (params, tx.init(params)), batches

