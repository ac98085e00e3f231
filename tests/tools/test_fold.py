"""Tests for autopar.inspect_fold: folding repeated layers into one row (the dump's and the
report's), optimizer state paired with its parameter, results that keep their input's
sharding."""
from __future__ import annotations

from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import optax

import autopar
from autopar.tools.fold import fold, fold_names, kept_results, layer_key, pair_optimizer_state


def test_layer_indices_are_the_numbers_of_layer_names():
    assert layer_key("params['block_3']['fc']") == ("params['block_\x00']['fc']", (3,))
    assert layer_key("h/0/w")[1] == (0,) and layer_key("blocks.3.w")[1] == (3,)
    assert layer_key("model.layers[2].linear1")[1] == (2,)
    assert layer_key("w1")[1] == () and layer_key("fc2_bias")[1] == ()   # part of a name
    assert fold_names(["l_0/w", "l_1/w", "l_2/w"]) == "l_{0..2}/w"
    assert fold_names([f"l_{i}/w" for i in (0, 2, 3, 5, 6, 7, 9, 11)]) == "l_{0,2,3,5,6,7,...}/w"


def test_fold_repeated_layers():
    rows = [("l_0/w", "[-, model]"), ("l_1/w", "[-, model]"), ("l_2/w", "[-, model]"),
            ("l_3/w", "[model, -]"), ("head", "[-]"), ("l_5/w", "[-, model]")]
    groups = fold(rows, lambda r: r[0], lambda r: r[1:])
    assert [(g.name, g.items[0][1], g.count) for g in groups] == [
        ("l_{0,1,2,5}/w", "[-, model]", 4), ("l_3/w", "[model, -]", 1), ("head", "[-]", 1)]
    # names that differ in a number that is no layer index stay apart
    assert [g.name for g in fold(["w1", "w2"], str, lambda r: 0)] == ["w1", "w2"]


def test_optimizer_state_pairs_with_its_parameter_and_results_with_their_input():
    leaf = lambda path, spec=((0,),): NS(path=path, spec=spec)
    params = [leaf("state.params['w']"), leaf("state.params['b']")]
    opt = [leaf("state.opt_state[0].mu['w']"), leaf("state.opt_state[0].nu['w']"),
           leaf("state.opt_state[0].count")]
    paired, unpaired = pair_optimizer_state(params, opt)
    assert {i: [slot for slot, _ in v] for i, v in paired.items()} == {0: ["mu", "nu"]}
    assert unpaired == [opt[2]]
    outs = [leaf("result[0] (next state.params['w'])"), leaf("result[1] (next state.params['b'])",
                                                           ((),)), leaf("result[2]")]
    shown, kept = kept_results(params, outs)
    assert kept == outs[:1] and shown == outs[1:]


def _gpt_plan(config, plan_cache=False):
    from flax.training import train_state

    from autopar.models.gpt import GPT, gpt_loss, make_gpt_batch

    def create():
        model = GPT(config)
        params = model.init(jax.random.key(0), jnp.zeros((1, config.seq_len), jnp.int32))
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adamw(1e-3))

    def step(state, batch):
        def loss_fn(params):
            return gpt_loss(state.apply_fn(params, batch["tokens"]), batch["tokens"])
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
    state = jax.eval_shape(create)
    batch = jax.eval_shape(lambda: make_gpt_batch(jax.random.key(1), 16, config))
    par = autopar.parallelize(step, mesh=jax.make_mesh((2, 4), ("data", "model")),
                              batch_argnums=(1,), plan_cache=plan_cache)
    return par.get_plan(state, batch)


def test_repeated_layers_fold_in_the_dump():
    from autopar.models.gpt import GPTConfig
    small = dict(vocab_size=64, seq_len=8, hidden=32, num_heads=2)
    two, four = (_gpt_plan(GPTConfig(num_layers=n, **small)) for n in (2, 4))
    d2, d4 = autopar.dump(two), autopar.dump(four)
    assert len(four.inputs) > len(two.inputs) + 40
    assert len(d4.splitlines()) <= len(d2.splitlines()) + 2, d4
    assert "block_{0..3}" in d4 and " x4 " in d4
    assert "replicated on every device" in d4
