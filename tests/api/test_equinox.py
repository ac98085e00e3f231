"""Equinox steps written for `eqx.filter_jit` run under `autopar.parallelize` by swapping the
decorator (issue 26): an MLP and a 2-block attention model (eqx.nn.MultiheadAttention,
LayerNorm, MLP with gelu), adamw on `eqx.filter(model, eqx.is_array)`, equal to
`eqx.filter_jit` over 3 steps with ShardParallel, with 4 microbatches and as a 2-stage
pipeline (`autopar.value_and_grad` for the last two), on a 2 x 4 mesh."""
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import autopar
from support.equivalence import assert_losses_close, assert_norm_close
from support.steps import mesh_of

STEPS = 3


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, d, heads, key):
        k1, k2 = jax.random.split(key)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.mlp = eqx.nn.MLP(d, d, 4 * d, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):                 # x: [seq, d]
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class Net(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, din, d, heads, num_blocks, dout, key):
        ks = jax.random.split(key, num_blocks + 2)
        self.embed = eqx.nn.Linear(din, d, key=ks[0])
        self.blocks = [Block(d, heads, k) for k in ks[1:-1]]
        self.head = eqx.nn.Linear(d, dout, key=ks[-1])

    def __call__(self, x):
        x = jax.vmap(self.embed)(x)
        for b in self.blocks:
            x = b(x)
        return jax.vmap(self.head)(x)


def _case(name):
    keys = jax.random.split(jax.random.key(0), 3)
    if name == "mlp":
        model = eqx.nn.MLP(16, 4, 64, 2, key=keys[0])
        x, y = jax.random.normal(keys[1], (32, 16)), jax.random.normal(keys[2], (32, 4))
    else:
        model = Net(8, 64, 4, 2, 8, keys[0])
        x, y = (jax.random.normal(keys[1], (32, 16, 8)),
                jax.random.normal(keys[2], (32, 16, 8)))
    tx = optax.adamw(1e-3)
    return model, tx, tx.init(eqx.filter(model, eqx.is_array)), x, y


def _step(tx, value_and_grad):
    def step(model, opt_state, x, y):
        def loss_fn(m, x, y):
            return jnp.mean((jax.vmap(m)(x) - y) ** 2)
        loss, grads = value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss
    return step


def _run(fn, model, opt_state, x, y):
    losses = []
    for _ in range(STEPS):
        model, opt_state, loss = fn(model, opt_state, x, y)
        losses.append(loss)
    return model, opt_state, jnp.stack(losses)


@pytest.fixture(scope="module", params=["mlp", "attention"])
def case(request):
    model, tx, opt_state, x, y = _case(request.param)
    ref = _run(eqx.filter_jit(_step(tx, eqx.filter_value_and_grad)), model, opt_state, x, y)
    return dict(name=request.param, model=model, tx=tx, opt=opt_state, x=x, y=y, ref=ref)


METHODS = {
    "shard": (False, lambda: autopar.ShardParallel()),
    "shard, autopar.value_and_grad": (True, lambda: autopar.ShardParallel()),
    "4 microbatches": (True, lambda: autopar.ShardParallel(num_microbatches=4)),
    "2-stage pipeline": (True, lambda: autopar.PipeshardParallel(
        num_microbatches=4, layer_option=autopar.AutoLayerOption(num_layers=2),
        stage_option=autopar.UniformStageOption(num_stages=2))),
}


@pytest.mark.parametrize("how", list(METHODS))
def test_equals_eqx_filter_jit(case, how):
    marked, method = METHODS[how]
    vg = autopar.value_and_grad if marked else eqx.filter_value_and_grad
    par = autopar.parallelize(_step(case["tx"], vg), mesh=mesh_of((2, 4)), method=method(),
                              batch_argnums=(2, 3), plan_cache=False)
    got = _run(par, case["model"], case["opt"], case["x"], case["y"])
    model, want = got[0], case["ref"][0]
    assert type(model) is type(want)
    static = lambda m: jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_array, inverse=True))
    assert static(model) == static(want)          # activations etc. come back as they were
    # Adam's normalization turns rounding noise in near-zero gradients into update-sized
    # differences entry by entry (see tests/api/test_equivalence.py): losses entrywise, the
    # trained model and optimizer state by the norm over the tree
    assert_losses_close(case["ref"][2], got[2], rtol=1e-5, smooth=True)
    arrays = lambda t: eqx.filter(t[:2], eqx.is_array)
    assert_norm_close(arrays(case["ref"]), arrays(got), rtol=1e-5, what=how)
    plan = par.get_plan(case["model"], case["opt"], case["x"], case["y"])
    if "pipeline" in how:
        assert len(plan.stages) == 2


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def test_the_attention_model_takes_at_most_half_the_memory_of_one_device():
    model, tx, opt_state, x, y = _case("attention")
    step = _step(tx, eqx.filter_value_and_grad)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), batch_argnums=(2, 3),
                              plan_cache=False)
    sharded = _peak(par.get_compiled(model, opt_state, x, y))
    arrays, static = eqx.partition(model, eqx.is_array)
    one = jax.jit(lambda a, o, x, y: eqx.filter(step(eqx.combine(a, static), o, x, y),
                                                eqx.is_array))
    single = _peak(one.lower(arrays, opt_state, x, y).compile())
    assert sharded <= 0.5 * single, (sharded, single)


def test_autopar_plan_takes_an_abstract_equinox_model():
    """`autopar.plan` on `eqx.filter_eval_shape` values (nothing allocated): the arrays are
    planned under their module paths, the static leaves stay out of the plan."""
    tx = optax.adamw(1e-3)
    model = eqx.filter_eval_shape(lambda: eqx.nn.MLP(64, 64, 256, 2, key=jax.random.key(0)))
    opt_state = eqx.filter_eval_shape(lambda m: tx.init(eqx.filter(m, eqx.is_array)), model)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    plan = autopar.plan(_step(tx, eqx.filter_value_and_grad), model, opt_state, x, x,
                        cluster=autopar.ClusterSpec.preset("cpu"), batch_argnums=(2, 3))
    n_arrays = sum(isinstance(x, jax.ShapeDtypeStruct)
                   for x in jax.tree_util.tree_leaves((model, opt_state)))
    assert len(plan.inputs) == n_arrays + 2
    assert any(".layers[0].weight" in t.path for t in plan.inputs), [t.path for t in plan.inputs]


@pytest.mark.parametrize("how", ["shard", "2-stage pipeline"])
def test_step_init_creates_an_equinox_model_in_the_plan_layout(how):
    """`step.init` with a `create_state` that builds an Equinox model and its optimizer state:
    it comes back as the module (activations in place) with every array on the plan's
    sharding, the step runs it without re-planning and equals `eqx.filter_jit`."""
    _, tx, _, x, y = _case("attention")
    key = jax.random.key(3)

    def create(k):
        model = Net(8, 64, 4, 2, 8, k)
        return model, tx.init(eqx.filter(model, eqx.is_array))

    vg = autopar.value_and_grad if "pipeline" in how else eqx.filter_value_and_grad
    inner = _step(tx, vg)
    def step(state, x, y):                    # the model and optimizer state as one argument
        model, opt_state, loss = inner(*state, x, y)
        return (model, opt_state), loss

    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=METHODS[how][1](),
                              batch_argnums=(1, 2), plan_cache=False)
    state = par.init(create, x, y, create_args=(key,))
    want = create(key)
    assert type(state[0]) is Net
    static = lambda m: jax.tree_util.tree_leaves(eqx.filter(m, eqx.is_array, inverse=True))
    assert static(state) == static(want)
    placed = jax.tree_util.tree_leaves(eqx.filter(par.input_shardings(state, x, y)[0],
                                                  lambda s: hasattr(s, "spec")))
    assert [a.sharding for a in jax.tree_util.tree_leaves(eqx.filter(state, eqx.is_array))] \
        == placed
    assert_norm_close(eqx.filter(want, eqx.is_array), eqx.filter(state, eqx.is_array),
                      rtol=1e-6, what="created state")
    if how == "shard":                          # step.lower takes the module as it is
        assert 'mhlo.num_partitions = 8' in par.lower(state, x, y).as_text()
    ref = eqx.filter_jit(step)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        state, loss = par(state, x, y)
        want, ref_loss = ref(want, x, y)
        losses.append(loss)
        ref_losses.append(ref_loss)
    assert len(par._cache) == 1                  # the init's plan was used
    assert_losses_close(jnp.stack(ref_losses), jnp.stack(losses), rtol=1e-5, smooth=True)
