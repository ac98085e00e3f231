"""Methods keep their promises, checked on the plan and on the compiled HLO (8 simulated CPU
devices): DataParallel is one gradient all-reduce; ZeRO-2 shards the optimizer state and the
update and gathers each parameter once; ZeRO-3 gathers parameters, never activations; a batch
pin holds along the whole batch path."""
import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import autopar
from autopar.cost.hlo import collectives, summary
from autopar.intra_op.batch_dims import batch_dims
from autopar.models.bert import (
    BertMLM,
    LayerOnly,
    bert_batch,
    bert_state,
    bert_step,
    layer_batch,
    layer_step,
)
from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch
from autopar.models.mlp import mse_loss
from support.steps import mesh_of, mlp_adam_state


def _mlp(batch_size=32, hidden=256, num_layers=6):
    state, batch = mlp_adam_state(hidden, num_layers, batch_size)

    def step(state, batch):
        def loss_fn(p):
            return mse_loss(state.apply_fn(p, batch["x"]), batch["y"])
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, grads
    return step, state, batch


def _bert_layer():
    model, batch = LayerOnly(64, 4), layer_batch(16, 16, 64)
    params = model.init(jax.random.key(0), batch["x"], batch["attention"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adam(1e-3))
    return layer_step, state, batch


def _bert_mlm():
    model, batch = BertMLM(vocab=128, seq=16, hidden=64, heads=4, layers=2), bert_batch(16, 16, 128)
    return bert_step, bert_state(model, batch), batch


CASES = {"mlp": _mlp, "bert_layer": _bert_layer, "bert_mlm": _bert_mlm}


def _run(case, method, mesh_shape):
    step, state, batch = CASES[case]()
    par = autopar.parallelize(step, mesh=mesh_of(mesh_shape), method=method)
    compiled = par.get_compiled(state, batch)
    return par, step, state, batch, compiled


def _param_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state.params))


def _check_equal(par, step, state, batch, rtol=1e-5):
    ref, got = jax.jit(step)(state, batch), par(state, batch)
    np.testing.assert_allclose(got[1], ref[1], rtol=rtol)
    if len(ref) > 2:                                     # gradients, where the step returns them
        for a, b in zip(jax.tree_util.tree_leaves(ref[2]), jax.tree_util.tree_leaves(got[2])):
            np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * float(np.abs(a).max()))
    for a, b in zip(jax.tree_util.tree_leaves(ref[0].params),
                    jax.tree_util.tree_leaves(got[0].params)):
        np.testing.assert_allclose(b, a, atol=1e-3)      # Adam: sign-like steps of lr 1e-3


@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 2)])
def test_data_parallel_is_one_all_reduce_and_replicated_state(mesh_shape):
    par, step, state, batch, compiled = _run("mlp", autopar.DataParallel(), mesh_shape)
    assert {k: n for k, (n, _) in summary(collectives(compiled.as_text())).items()} == \
        {"all-reduce": 1}
    plan = par.get_plan(state, batch)
    for t in plan.inputs:
        split = any(t.spec)
        assert split == (t.role == "batch"), (t.path, t.spec)
    assert not any(any(t.spec) for t in plan.outputs)
    _check_equal(par, step, state, batch)


def test_data_parallel_bert_mlm_has_no_gather():
    par, step, state, batch, compiled = _run("bert_mlm", autopar.DataParallel(), (2, 4))
    found = summary(collectives(compiled.as_text()))
    assert set(found) == {"all-reduce"}, found        # gradients (and the loss's weight sum)
    # The tied embedding's two gradient contributions (lookup and output projection) are
    # each reduced before they are added: one table more than the parameters.
    table = 128 * 64 * 4
    assert found["all-reduce"][1] <= _param_bytes(state) + table + 64
    _check_equal(par, step, state, batch)


# BERT MLM repeats BERT's layer with an embedding and a head (make test-slow); its data-parallel
# plan is checked in make test (test_data_parallel_bert_mlm_has_no_gather).
@pytest.mark.parametrize("case", ["mlp", "bert_layer",
                                  pytest.param("bert_mlm", marks=pytest.mark.slow)])
def test_zero2_gathers_parameters_once_and_shards_state_and_update(case):
    par, step, state, batch, compiled = _run(case, autopar.Zero2Parallel(), (2, 4))
    found = summary(collectives(compiled.as_text()))
    params = _param_bytes(state)
    assert found.get("all-gather", (0, 0))[1] <= params
    assert set(found) <= {"all-gather", "all-reduce", "reduce-scatter"}, found
    plan = par.get_plan(state, batch)
    opt = [t for t in plan.inputs if t.role == "opt_state" and np.prod(t.shape) >= 8]
    assert opt and all(any(t.spec) for t in opt)
    # The update runs on shards: fewer FLOPs per device than data parallel's, by at least
    # 8 per parameter on the 7/8 of the parameters a device does not update (Adam does ~13).
    dp = _run(case, autopar.DataParallel(), (2, 4))[4]
    n = params / 4
    assert dp.cost_analysis()["flops"] - compiled.cost_analysis()["flops"] >= 8 * n * 7 / 8
    _check_equal(par, step, state, batch)


def test_zero3_gathers_parameters_not_activations():
    par, step, state, batch, compiled = _run("mlp", autopar.Zero3Parallel(), (2, 4))
    found = summary(collectives(compiled.as_text()))
    params = _param_bytes(state)
    assert 0 < found["all-gather"][1] <= 2 * params
    assert set(found) <= {"all-gather", "all-reduce", "reduce-scatter"}, found
    # one gradient reduction (the loss scalar rides along): no activation is all-reduced
    assert found["all-reduce"][1] <= params + 64
    plan = par.get_plan(state, batch)
    assert all(any(t.spec) for t in plan.inputs if t.role in ("param", "opt_state")
               and np.prod(t.shape) >= 8)
    _check_equal(par, step, state, batch)


def test_zero2_with_microbatches_keeps_the_optimizer_state_sharded():
    step, state, batch = _mlp(hidden=64, num_layers=3)

    def marked(state, batch):
        def loss_fn(p):
            return mse_loss(state.apply_fn(p, batch["x"]), batch["y"])
        loss, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, grads
    method = autopar.Zero2Parallel(num_microbatches=2)
    par = autopar.parallelize(marked, mesh=mesh_of((2, 4)), method=method)
    plan = par.get_plan(state, batch)
    assert plan.method == "zero2"
    opt = [t for t in plan.inputs if t.role == "opt_state" and np.prod(t.shape) >= 8]
    assert opt and all(any(t.spec) for t in opt)
    got = par(state, batch)
    for leaf in jax.tree_util.tree_leaves(got[0].opt_state):
        if leaf.size >= 8:
            assert leaf.addressable_shards[0].data.size < leaf.size      # held in pieces
    _check_equal(par, step, state, batch)


def _tiny_gpt():
    cfg = GPTConfig(vocab_size=128, seq_len=16, num_layers=2, hidden=64, num_heads=4)
    batch = make_gpt_batch(jax.random.key(1), 16, cfg)
    net = GPT(cfg)
    state = train_state.TrainState.create(
        apply_fn=net.apply, params=net.init(jax.random.key(0), batch["tokens"]),
        tx=optax.sgd(0.1))

    def step(state, batch):
        def loss_fn(p):
            return gpt_loss(state.apply_fn(p, batch["tokens"]), batch["tokens"])
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
    return step, state, batch


def _batch_path_specs(par, state, batch):
    """(batch dim, spec) of every pinned value on the batch path of the plan."""
    graph, plan = par.get_graph(state, batch), par.get_plan(state, batch)
    dims = batch_dims(graph)
    out = [(dims[t], spec) for t, spec in plan.constraints if dims[t] is not None]
    out += [(0, t.spec) for t in plan.inputs if t.role == "batch"]
    return out


def test_batch_axis_pin_holds_along_the_batch_path():
    step, state, batch = _tiny_gpt()
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(batch_axis="data"))
    specs = _batch_path_specs(par, state, batch)
    assert len(specs) > 20
    data = par.get_plan(state, batch).axis_names.index("data")
    assert all(spec[d][:1] == (data,) for d, spec in specs), \
        [s for s in specs if s[1][s[0]][:1] != (data,)][:3]
    found = summary(collectives(par.get_compiled(state, batch).as_text()))
    assert "all-to-all" not in found
    ref, got = jax.jit(step)(state, batch), par(state, batch)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(ref[0].params),
                    jax.tree_util.tree_leaves(got[0].params)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_batch_axis_errors():
    with pytest.raises(autopar.InvalidArgumentError, match="batch_axis"):
        autopar.ShardParallel(batch_axis=3)
    step, state, batch = _tiny_gpt()
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(batch_axis="rows"))
    with pytest.raises(autopar.InvalidArgumentError, match="no axis 'rows'"):
        par.get_plan(state, batch)


def test_data_parallel_cnn_with_batchnorm_and_pooling_at_batch_8():
    """A 3-block CNN (conv, BatchNorm, max pool) at batch 8 under DataParallel: the batch
    stays split end to end; the all-reduces are BatchNorm's statistics and one for the
    gradients, nothing is gathered."""
    from support.layer_models import cnn_case
    step, state, batches = cnn_case(batch_size=8, image_size=16)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=autopar.DataParallel())
    plan = par.get_plan(state, batches[0])
    pools = [o for o in plan.operators if o.primitive.startswith(("reduce_window",
                                                                   "select_and_scatter"))]
    assert pools and all(o.out_spec[0] == (0, 1) for o in pools)
    assert not plan.fallbacks
    found = collectives(par.get_compiled(state, batches[0]).as_text())
    assert {c.kind for c in found} == {"all-reduce"}
    # BatchNorm's statistics (3 forward, 3 backward; XLA puts the BatchNorm parameters'
    # gradients into the last of those) and one all-reduce for every other gradient
    grads = [c for c in found if "conv_general_dilated" in c.op_name]
    assert len(grads) == 1 and all("Conv_" not in c.op_name for c in found if c not in grads)
    assert all("BatchNorm" in c.op_name for c in found if c not in grads)
    assert len(found) == 7, [c.op_name for c in found]
    ref = jax.jit(step)(state, batches[0])
    got = par(state, batches[0])
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(ref[0]), jax.tree_util.tree_leaves(got[0])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_zero_spec_keeps_a_layer_stack_dimension_whole():
    from autopar.intra_op.constraints import zero_spec
    assert zero_spec((48, 32), (2, 4)) == ((0, 1), ())            # the largest dim
    assert zero_spec((48, 32), (2, 4), whole=1) == ((), (0, 1))   # a stack: not its layers
    assert zero_spec((48, 3), (2, 4), whole=1) == ((), ())        # nothing else divides


@pytest.mark.parametrize("tx_name", ["adafactor", "adamw-clip"])
def test_zero2_statistics_of_the_update_cost_no_collective(tx_name, recwarn):
    """ZeRO-2 with an update that takes statistics of whole gradients (Adafactor's factored
    second moments and update clipping; a global-norm clip): on XLA:CPU, whose reduce-scatter
    is an all-reduce and a slice, the statistics are computed from the summed gradient, so
    the step compiles one gradient all-reduce (25 all-reduces before, each statistic on
    shards an all-reduce behind the gradient's that XLA could not combine), the factored
    moments stay whole (no gather), and the step equals jax.jit's."""
    from support.steps import make_case
    tx = {"adafactor": optax.adafactor(1e-3),
          "adamw-clip": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))}[tx_name]
    step, state, batches = make_case("mlp", "linen", tx, batch_size=32, hidden=256,
                                     num_layers=6)
    par = autopar.parallelize(step, mesh=mesh_of((1, 8)), method=autopar.Zero2Parallel(),
                              batch_argnums=(1,))
    found = summary(collectives(par.get_compiled(state, batches[0]).as_text()))
    reductions = found.get("all-reduce", (0, 0))[0] + found.get("reduce-scatter", (0, 0))[0]
    assert 1 <= reductions <= 3, found
    plan = par.get_plan(state, batches[0])
    moments = [t for t in plan.inputs if t.role == "opt_state" and np.prod(t.shape) >= 256
               and "v_row" not in t.path and "v_col" not in t.path]
    assert moments and all(any(t.spec) for t in moments)           # the state is still ZeRO's
    if tx_name == "adafactor":
        factored = [t for t in plan.inputs if t.role == "opt_state" and "v_row" in t.path]
        assert factored and not any(any(t.spec) for t in factored)
        assert found.get("all-gather", (0, 0))[0] <= 12, found      # parameters and biases
    assert not [w for w in recwarn if "could not pin" in str(w.message)]
    ref, got = jax.jit(step)(state, batches[0]), par(state, batches[0])
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(ref[2]), jax.tree_util.tree_leaves(got[2])):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_data_parallel_lays_a_mask_from_a_fixed_key_as_the_batch_it_meets(caplog):
    """A dropout mask drawn from a fixed key (no batch dimension in its lineage) lies as the
    batch-split activations it multiplies: DataParallel meets all its pins, gathers nothing,
    and costs what it costs without dropout (it was priced 1.65x that, gathering the masked
    activations), and equals jax.jit."""
    from support.layer_models import dropout_case
    plans = {}
    for deterministic in (False, True):
        step, state, batches = dropout_case(deterministic=deterministic)
        par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=autopar.DataParallel(),
                                  plan_cache=False)
        with caplog.at_level("INFO", logger="autopar.intra_op.solve"):
            caplog.clear()
            plans[deterministic] = par.get_plan(state, batches[0])
            assert "could not pin" not in caplog.text
        if not deterministic:
            hlo = par.get_compiled(state, batches[0]).as_text()
            assert "all-gather" not in summary(collectives(hlo)), summary(collectives(hlo))
            want, got = jax.jit(step)(state, batches[0]), par(state, batches[0])
            np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
            for a, b in zip(jax.tree_util.tree_leaves(want[2]), jax.tree_util.tree_leaves(got[2])):
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    dropped, plain = plans[False].predicted_step_s, plans[True].predicted_step_s
    assert dropped <= 1.05 * plain, (dropped, plain)
