"""The user's sharding annotations (explicit-sharding JAX, `with_sharding_constraint`, Flax
logical constraints) as pins, hints or ignored; a step planned and run under an Explicit mesh
(`jax.set_mesh`) equals jax.jit's and hands results back on the user's mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import autopar
from autopar.core.enums import Annotations
from autopar.core.errors import InvalidArgumentError
from autopar.frontend.tracer import trace
from autopar.intra_op.annotations import annotation_specs

DATA_MODEL = ((0,), (1,))


def _explicit_mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _params(seed=0):
    rng = np.random.RandomState(seed)
    return {"w1": jnp.asarray(rng.randn(32, 64) * 0.2, jnp.float32),
            "w2": jnp.asarray(rng.randn(64, 32) * 0.2, jnp.float32)}


def _batch(i):
    return jnp.asarray(np.random.RandomState(10 + i).randn(16, 32), jnp.float32)


def annotated_loss(p, x):
    """An MLP written for explicit sharding: einsums with `out_sharding=` and a `reshard`."""
    h = jnp.tanh(jnp.einsum("bd,df->bf", x, p["w1"], out_sharding=P("data", "model")))
    y = jnp.einsum("bf,fd->bd", h, p["w2"], out_sharding=P("data", None))
    y = jax.sharding.reshard(y, P("data", None))
    return jnp.mean((y - x) ** 2)


def annotated_step(p, x):
    loss, g = jax.value_and_grad(annotated_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss


def _hidden(graph):
    """The tensor id of the annotated hidden activation (the first einsum's result)."""
    dots = [n for n in graph.nodes if n.primitive == "dot_general"]
    return dots[0].outputs[0]


def _run(step, params, steps=3):
    out = []
    for i in range(steps):
        params, loss = step(params, _batch(i))
        out.append((float(loss), jax.tree.map(np.asarray, params)))
    return params, out


def _assert_same(ref, got):
    for (la, pa), (lb, pb) in zip(ref, got):
        np.testing.assert_allclose(lb, la, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_annotation_specs_read_forward_out_shardings_and_reshards():
    mesh = _explicit_mesh()
    with jax.set_mesh(mesh):
        graph = trace(annotated_step, (_params(), _batch(0)))
    pins = annotation_specs(graph, ("data", "model"), (2, 4))
    assert pins[_hidden(graph)] == DATA_MODEL
    # Only split, forward-pass annotations: the einsum results and the reshard.
    assert sorted(pins.values()) == sorted([DATA_MODEL, ((0,), ()), ((0,), ())])
    with pytest.raises(InvalidArgumentError, match="names axis 'data'.*annotations='ignore'"):
        annotation_specs(graph, ("x", "y"), (2, 4))
    with pytest.raises(InvalidArgumentError, match="does not divide"):
        annotation_specs(graph, ("data", "model"), (2, 128))
    assert annotation_specs(graph, ("x", "y"), (2, 4), strict=False) == {}


@pytest.mark.parametrize("mode", ["pin", "hint", "ignore"])
def test_explicit_mesh_step_equals_jax_jit_and_returns_on_the_users_mesh(mode):
    """First call inside `jax.set_mesh` (Explicit axes), the next ones outside it; numbers
    equal jax.jit's over 3 steps; results are arrays on the user's mesh with its axis types,
    so code after the step under `jax.set_mesh` keeps working."""
    mesh = _explicit_mesh()
    with jax.set_mesh(mesh):
        _, ref = _run(jax.jit(annotated_step), _params())
        step = autopar.parallelize(annotated_step, mesh=mesh, plan_cache=False,
                                   method=autopar.ShardParallel(annotations=mode))
        params, loss = step(_params(), _batch(0))
    for leaf in jax.tree.leaves((params, loss)):
        assert leaf.sharding.mesh == mesh
        assert leaf.sharding.mesh.axis_types == (AxisType.Explicit,) * 2
    with jax.set_mesh(mesh):              # the user's code after the step: evaluation
        h = jnp.einsum("bd,df->bf", _batch(0), params["w1"], out_sharding=P("data", None))
        assert h.sharding.spec == P("data", None)
    _, got = _run(step, _params())        # later calls, outside the context mesh
    _assert_same(ref, got)
    plan = step.get_plan(_params(), _batch(0))
    graph = step.get_graph(_params(), _batch(0))
    spec = dict(plan.constraints).get(_hidden(graph))
    if mode == "pin":          # Megatron's split, as annotated
        assert spec == DATA_MODEL
    if mode == "ignore":       # the ILP alone picks another plan for this small MLP
        assert spec != DATA_MODEL
    assert plan.method == "shard_parallel"


def test_bad_annotations_option():
    with pytest.raises(InvalidArgumentError, match="annotations='maybe'.*pin"):
        autopar.ShardParallel(annotations="maybe")
    assert autopar.ShardParallel(annotations="hint").annotations is Annotations.HINT


class LogicalMLP(nn.Module):
    """Flax logical partitioning: params boxed with logical names, activations constrained
    with `nn.with_logical_constraint` (a `with_sharding_constraint` under the rules)."""

    @nn.compact
    def __call__(self, x):
        w1 = self.param("w1", nn.with_logical_partitioning(nn.initializers.normal(0.2),
                                                           ("embed", "mlp")), (32, 64))
        w2 = self.param("w2", nn.with_logical_partitioning(nn.initializers.normal(0.2),
                                                           ("mlp", "embed")), (64, 32))
        h = nn.with_logical_constraint(jnp.tanh(x @ w1), ("batch", "mlp"))
        return nn.with_logical_constraint(h @ w2, ("batch", "embed"))


def test_flax_logical_constraints_are_pinned_on_an_auto_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rules = (("batch", "data"), ("mlp", "model"), ("embed", None))
    model = LogicalMLP()
    params = nn.unbox(model.init(jax.random.key(0), _batch(0)))

    def step(p, x):
        with nn.logical_axis_rules(rules):
            loss, g = jax.value_and_grad(
                lambda q: jnp.mean((model.apply(q, x) - x) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    with jax.set_mesh(mesh):
        ref = _run(jax.jit(step), params)[1]
    par = autopar.parallelize(step, mesh=mesh, plan_cache=False)
    with jax.set_mesh(mesh):        # as jax.jit is called: the constraints need the mesh
        got = _run(par, params)[1]
        graph = par.get_graph(params, _batch(0))
    _assert_same(ref, got)
    pins = annotation_specs(graph, ("data", "model"), (2, 4))
    assert DATA_MODEL in pins.values()
    with jax.set_mesh(mesh):
        constraints = dict(par.get_plan(params, _batch(0)).constraints)
    assert all(constraints.get(t, s) == s for t, s in pins.items())


@pytest.mark.parametrize("method", [
    autopar.ShardParallel(num_microbatches=4),
    autopar.PipeshardParallel(num_microbatches=2,
                              layer_option=autopar.AutoLayerOption(num_layers=2),
                              stage_option=autopar.UniformStageOption(num_stages=2))],
    ids=["accumulation", "pipeline"])
def test_annotated_step_under_microbatches_and_stages_equals_jax_jit(method):
    """The explicit-sharding MLP with the loss taken by autopar.value_and_grad, under
    gradient accumulation and a 2-stage pipeline on the user's Explicit mesh."""
    def step(p, x):
        loss, g = autopar.value_and_grad(annotated_loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    mesh = _explicit_mesh()
    with jax.set_mesh(mesh):
        ref = _run(jax.jit(step), _params())[1]
        got = _run(autopar.parallelize(step, mesh=mesh, method=method, plan_cache=False),
                   _params())[1]
    _assert_same(ref, got)
