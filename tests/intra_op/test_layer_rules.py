"""Tests for autopar.intra_op.layer_rules and the common-layer rules in rules.py (pooling,
max-pool gradients, PRNG keys, random bits, grouped/depthwise convolution), the fallback
warning, and the CNN / depthwise / dropout models of tests/support/layer_models.py end to end on 8
simulated CPU devices (plan, compiled HLO, memory, equivalence with jax.jit)."""
from __future__ import annotations

import collections
import pathlib
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import autopar
from autopar.core.spec import enumerate_specs, num_shards
from autopar.cost.cluster import ClusterSpec
from autopar.cost.model import CostModel
from autopar.frontend.tracer import trace
from autopar.intra_op.follow import FOLLOW_RULES
from autopar.intra_op.layer_rules import key_op, pool, window_dims, window_select
from autopar.intra_op.rules import RuleContext, conv_rule, random_bits_rule
from support.equivalence import assert_params_close
from support.hlo import hlo_collectives
from support.layer_models import cnn_case, depthwise_case, dropout_case
from support.steps import assert_equivalent, mesh_of, run_steps

THIS_FILE = pathlib.Path(__file__).name


def _ctx(fn, *args, mesh_shape=(2, 4)):
    graph = trace(fn, args)
    mesh = ClusterSpec.preset("cpu").logical_mesh(mesh_shape, ("data", "model"))
    return RuleContext(graph=graph, cost=CostModel(mesh=mesh), deferred=frozenset()), graph


def _node(graph, primitive, k=0):
    return [n for n in graph.nodes if n.primitive == primitive][k]


def _kinds(compiled) -> collections.Counter:
    return collections.Counter(k for k, _ in hlo_collectives(compiled.as_text()))


# -- rules, on single operators -------------------------------------------------------------

def test_window_dims():
    ctx, g = _ctx(lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)), jnp.ones((8, 8, 8, 4)))
    assert window_dims(_node(g, "reduce_window_max").eqn.params, 4) == [1, 2]
    # a 1-wide window with padding still mixes (shifts) elements along that dim
    ctx, g = _ctx(lambda x: nn.avg_pool(x, (1, 3), padding=((1, 1), (1, 1))),
                  jnp.ones((8, 8, 8, 4)))
    assert window_dims(_node(g, "reduce_window_sum").eqn.params, 4) == [1, 2]


def test_pool_keeps_batch_and_channel_splits_and_gathers_windows():
    ctx, g = _ctx(lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)), jnp.ones((8, 8, 8, 4)))
    node = _node(g, "reduce_window_max")
    s = pool(ctx, node, 0, ((0,), (1,), (), ()))        # batch on data, height on model
    assert s.in_specs == (((0,), (), (), ()),) and s.out_specs == (((0,), (), (), ()),)
    s = pool(ctx, node, 0, ((0,), (), (), (1,)))        # batch and channels: kept
    assert s.out_specs == (((0,), (), (), (1,)),) and s.comm_s == 0.0
    # the work is split as the result is
    assert s.compute_s < pool(ctx, node, 0, ((), (), (), ())).compute_s


def test_generic_reduce_window_and_init_value():
    def f(x):
        return jax.lax.reduce_window(x, 0.0, lambda a, b: a + 2.0 * b, (1, 3, 1), (1, 1, 1),
                                     "SAME")
    ctx, g = _ctx(f, jnp.ones((8, 6, 4)))
    node = _node(g, "reduce_window")
    assert FOLLOW_RULES["reduce_window"] is pool
    s = pool(ctx, node, 0, ((0,), (1,), ()))
    assert s.in_specs == (((0,), (), ()), None) and s.out_specs == (((0,), (), ()),)


def test_max_pool_gradient_shares_the_non_window_layout():
    def f(x):
        return nn.max_pool(x, (2, 2), strides=(2, 2)).sum()
    ctx, g = _ctx(jax.grad(f), jnp.ones((8, 8, 8, 4)))
    node = _node(g, "select_and_scatter_add")          # (source: pooled, operand: input)
    assert g.tensors[node.inputs[0]].shape == (8, 4, 4, 4)
    s = window_select(ctx, node, 1, ((0,), (1,), (), ()))
    assert s.in_specs == (((0,), (), (), ()),) * 2 and s.out_specs == (((0,), (), (), ()),)


def test_key_ops_keep_the_split_of_a_batch_of_keys():
    def f(keys):
        return jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 3)))(keys)
    ctx, g = _ctx(f, jax.random.split(jax.random.key(0), 8))
    split = _node(g, "random_split")
    assert g.tensors[split.outputs[0]].shape == (8, 2)
    s = key_op(ctx, split, 0, ((0, 1),))
    assert s.in_specs == (((0, 1),),) and s.out_specs == (((0, 1), ()),)
    fold = _node(g, "random_fold_in")
    s = key_op(ctx, fold, 0, ((0,),))
    assert s.out_specs == (((0,),),)
    # a single key is a scalar: nothing to split
    ctx, g = _ctx(lambda k: jax.random.split(k), jax.random.key(0))
    s = key_op(ctx, _node(g, "random_split"), 0, ())
    assert s.in_specs == (None,) and s.out_specs == (((),),)


def test_random_bits_take_every_layout_with_the_key_replicated():
    ctx, g = _ctx(lambda k: jax.random.bits(k, (16, 8)), jax.random.key(0))
    node = _node(g, "random_bits")
    strategies = random_bits_rule(ctx, node)
    assert [s.out_specs[0] for s in strategies] == enumerate_specs((16, 8), (2, 4))
    assert all(s.in_specs == (None,) and s.comm_s == 0.0 for s in strategies)
    by_spec = {s.out_specs[0]: s for s in strategies}
    assert by_spec[((0, 1), ())].name == "d0@data*model"
    assert by_spec[((0, 1), ())].compute_s < by_spec[((), ())].compute_s


def test_random_bits_of_a_batch_of_keys_split_with_their_keys():
    ctx, g = _ctx(lambda ks: jax.vmap(lambda k: jax.random.bits(k, (4,)))(ks),
                  jax.random.split(jax.random.key(0), 8))
    for s in random_bits_rule(ctx, _node(g, "random_bits")):
        assert s.in_specs == (s.out_specs[0][:1],)


def test_threefry2x32_is_elementwise():
    import jax.extend.random as jrandom
    ctx, g = _ctx(lambda k, x: jrandom.threefry_2x32(k, x), jnp.zeros(2, jnp.uint32),
                  jnp.zeros((16, 8), jnp.uint32))
    node = _node(g, "threefry2x32")   # (key word 0, key word 1, counts: two flat halves)
    assert g.tensors[node.inputs[2]].shape == (64,)
    s = FOLLOW_RULES["threefry2x32"](ctx, node, 2, ((0, 1),))
    assert s.in_specs == (None, None, ((0, 1),), ((0, 1),))
    assert s.out_specs == (((0, 1),),) * 2


def _conv_strategies(groups: int, mesh_shape=(2, 4), channels=16):
    conv = nn.Conv(channels, (3, 3), feature_group_count=groups, use_bias=False)
    x = jnp.ones((8, 6, 6, channels))
    params = conv.init(jax.random.key(0), x)

    def loss(p, x):
        return conv.apply(p, x).sum()
    ctx, g = _ctx(jax.grad(loss, argnums=(0, 1)), params, x, mesh_shape=mesh_shape)
    convs = [n for n in g.nodes if n.primitive == "conv_general_dilated"]
    return ctx, g, convs


def test_depthwise_conv_splits_channels_without_a_collective():
    ctx, g, convs = _conv_strategies(groups=16)
    fwd, wgrad, dgrad = convs
    assert fwd.eqn.params["feature_group_count"] == 16
    assert wgrad.eqn.params["batch_group_count"] == 16
    by_name = {s.name: s for s in conv_rule(ctx, fwd)}
    s = by_name["n@data g@model"]
    assert s.comm_s == 0.0
    assert s.in_specs == (((0,), (), (), (1,)), ((), (), (), (1,)))
    assert s.out_specs == (((0,), (), (), (1,)),)
    assert "g@data*model" in by_name
    # weight gradient: groups with the output features, the batch contracted (an all-reduce)
    by_name = {s.name: s for s in conv_rule(ctx, wgrad)}
    assert by_name["g@model"].comm_s == 0.0
    assert by_name["g@model c@data"].comm.startswith("all-reduce(data)")
    assert by_name["g@model c@data"].out_specs == (((), (), (), (1,)),)
    assert {s.name for s in conv_rule(ctx, dgrad)} >= {"n@data g@model", "g@data*model"}


def test_grouped_conv_splits_only_whole_groups():
    ctx, g, convs = _conv_strategies(groups=2)          # 2 groups: never over 4 devices
    for node in convs:
        group_dim = (node.eqn.params["dimension_numbers"].lhs_spec[1]
                     if node.eqn.params["feature_group_count"] > 1
                     else node.eqn.params["dimension_numbers"].lhs_spec[0])
        names = set()
        for s in conv_rule(ctx, node):
            names.add(s.name)
            assert num_shards((s.in_specs[0][group_dim],), ctx.mesh_shape) in (1, 2)
        assert "g@data" in " ".join(names)
        assert not any("g@model" in n for n in names)


def test_reshape_with_dimensions_moves_the_split_of_the_transposed_dim():
    # (a, b) -> transpose -> (b, a) -> merge: the major merged dim is b.
    ctx, g = _ctx(lambda x: jax.lax.reshape(x, (32,), dimensions=(1, 0)), jnp.ones((4, 8)))
    node = _node(g, "reshape")
    s = FOLLOW_RULES["reshape"](ctx, node, 0, ((), (1,)))   # b split: stays split
    assert s.out_specs == (((1,),),) and s.in_specs[0] == ((), (1,))
    s = FOLLOW_RULES["reshape"](ctx, node, 0, ((1,), ()))   # a split: minor now, gathered
    assert s.out_specs == (((),),) and s.in_specs[0] == ((), ())


def test_pooling_flops():
    ctx, g = _ctx(lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)), jnp.ones((8, 8, 8, 4)))
    assert _node(g, "reduce_window_max").flops == 8 * 4 * 4 * 4 * 4


# -- the fallback warning -------------------------------------------------------------------

def test_unruled_primitive_replicating_a_large_tensor_warns():
    def f(x):
        return jnp.linalg.cholesky(x @ x.T + 64.0 * jnp.eye(64)).sum()  # no rule: cholesky
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    with pytest.warns(autopar.FallbackWarning) as record:
        plan = autopar.plan(f, x, cluster=ClusterSpec.preset("cpu"), mesh_shape=(2, 4),
                            batch_argnums=())
    text = [str(w.message) for w in record if "cholesky" in str(w.message)]
    assert len(text) == 1
    (fb,) = [f for f in plan.fallbacks if f.primitive == "cholesky"]
    assert fb.replicated_bytes == 2 * 64 * 64 * 4          # operand and result, whole
    assert f"{THIS_FILE}:" in text[0] and fb.source in text[0]
    assert "32.00 KiB" in text[0] and "Fix:" in text[0]


def test_scalar_fallback_does_not_warn():
    def f(x):
        return x * jax.lax.bessel_i0e(jnp.sum(x))     # no rule, on a scalar
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.FallbackWarning)
        plan = autopar.plan(f, jax.ShapeDtypeStruct((8, 4), jnp.float32),
                            cluster=ClusterSpec.preset("cpu"), mesh_shape=(2, 4),
                            batch_argnums=())
    assert [f.primitive for f in plan.fallbacks] == ["bessel_i0e"]
    assert plan.fallbacks[0].replicated_bytes == 0


# -- models, end to end ---------------------------------------------------------------------

@pytest.mark.parametrize("mesh_shape", [(2, 4), pytest.param((1, 8), marks=pytest.mark.slow)])
def test_cnn_batchnorm_maxpool_stays_batch_split(mesh_shape):
    step, state, batches = cnn_case(batch_size=32, image_size=32)
    par = autopar.parallelize(step, mesh=mesh_of(mesh_shape), batch_argnums=(1,))
    plan = par.get_plan(state, batches[0])
    everywhere = tuple(a for a, n in enumerate(mesh_shape) if n > 1)
    (x,) = [t for t in plan.inputs if t.path == "batch['x']"]
    assert x.spec == (everywhere, (), (), ())
    pools = [o for o in plan.operators if o.primitive.startswith(("reduce_window",
                                                                   "select_and_scatter"))]
    assert len(pools) == 8                    # 3 max + 1 avg pool, 1 + 3 gradients
    assert all(o.out_spec[0] == everywhere for o in pools)
    assert not plan.fallbacks
    compiled = par.get_compiled(state, batches[0])
    collectives = hlo_collectives(compiled.as_text())
    # one per BatchNorm statistics pair forward and backward (XLA combines the last backward
    # one with the first), one for every gradient: no all-gather of activations
    assert _kinds(compiled) == {"all-reduce": 7}
    for i in range(3):
        assert sum(f"jvp(CNN)/BatchNorm_{i}/reduce_sum" in n and "transpose" not in n
                   for _, n in collectives) == 1
    one_device = jax.jit(step).lower(state, batches[0]).compile().memory_analysis()
    assert compiled.memory_analysis().temp_size_in_bytes < one_device.temp_size_in_bytes / 4
    ref, got = run_steps(jax.jit(step), state, batches), run_steps(par, state, batches)
    assert_equivalent(ref, got, compare_params=True)           # ReLU, max pooling: routing
    assert_params_close(ref[0].batch_stats, got[0].batch_stats, steps=len(batches),
                        what="BatchNorm statistics")


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)])
def test_depthwise_conv_model_parallel(mesh_shape):
    step, state, batches = depthwise_case()
    rules = ((r"depthwise_\d+'\]\['kernel'\]", (None, None, None, "model")),
             (r"depthwise_\d+'\]\['bias'\]", ("model",)))
    par = autopar.parallelize(step, mesh=mesh_of(mesh_shape), batch_argnums=(1,),
                              method=autopar.ShardParallel(sharding_rules=rules))
    plan = par.get_plan(state, batches[0])
    depthwise = [o for o in plan.operators if "depthwise" in o.name_stack
                 and o.out_shape == (8, 8, 8, 32)]
    assert len(depthwise) == 4                # 2 forward, 2 input gradients
    for o in depthwise:
        assert "g@model" in o.strategy and o.out_spec[3] == (1,) and not o.communication
    compiled = par.get_compiled(state, batches[0])
    collectives = hlo_collectives(compiled.as_text())
    assert set(k for k, _ in collectives) == {"all-reduce"}
    # the channel-split depthwise convs need no collective, forward or backward
    assert not [n for _, n in collectives if re.search(r"depthwise_\d/conv", n)
                and "transpose" not in n]
    ref, got = run_steps(jax.jit(step), state, batches), run_steps(par, state, batches)
    assert_equivalent(ref, got, compare_params=True, smooth=True)     # tanh


def test_dropout_masks_sharded_and_bits_identical():
    mesh = mesh_of((2, 4))
    kw = dict(batch_size=512, features=512, hidden=512)
    temps = {}
    # The middle kernel's layout is pinned: (model, None) and (None, model) cost the planner
    # the same, and which one wins the tie moves XLA's temporaries by a [512, 512] / 8 buffer
    # (jax 0.12 broke it the other way for one of the two plans: the check below compares
    # plans that differ only by dropout).
    method = autopar.ShardParallel(sharding_rules=((r"Dense_1'\]\['kernel'\]", ("model", None)),))
    for deterministic in (True, False):
        step, state, batches = dropout_case(deterministic=deterministic, **kw)
        par = autopar.parallelize(step, mesh=mesh, batch_argnums=(1,), method=method)
        plan = par.get_plan(state, batches[0])
        compiled = par.get_compiled(state, batches[0])
        temps[deterministic] = compiled.memory_analysis().temp_size_in_bytes
        bits = [o for o in plan.operators if o.primitive == "random_bits"]
        assert len(bits) == (0 if deterministic else 2)
        assert not plan.fallbacks
    for o in bits:                            # masks cut over all 8 devices
        assert num_shards(o.out_spec, (2, 4)) == 8
    # no device builds a whole [512, 512] mask (nor its random bits)
    text = compiled.as_text()
    assert not re.search(r"\b(u32|pred)\[512,512\]", text)
    assert re.search(r"\bu32\[\d+,\d+\]", text)
    # Dropout costs each device no more than its share of the masks the backward needs (two
    # [512, 512] masks of 32-bit words split 8 ways) and of one dropped activation kept for the
    # next kernel's gradient (a [512, 512] float32 split 8 ways; whether XLA keeps it apart
    # from the undropped one depends on the layouts), not whole masks (on one device they add
    # 2 x 1 MiB). A ratio to the plan without dropout is no measure: that plan's own
    # temporaries move with unrelated choices (0.83x and 1.25x of it were both seen).
    masks, activation = 2 * 512 * 512 * 4 / 8, 512 * 512 * 4 / 8
    assert temps[False] - temps[True] <= 1.1 * (masks + activation), (temps, masks)
    ref, got = run_steps(jax.jit(step), state, batches), run_steps(par, state, batches)
    # the same random bits: the dropped units agree, so losses and parameters agree tightly
    assert_equivalent(ref, got, compare_params=True, rtol=1e-6)
