"""`inter_op.pipeline`: the loss found in the step (split_step), its layers (automatic or at
`mark_stage_boundary` calls) and its stage slices (parameter, data and activation inputs;
outputs, including a skip connection that crosses two stages and loss outputs)."""
import jax
import jax.numpy as jnp
import optax
import pytest

import autopar
from autopar.core.graph import TensorKind
from autopar.frontend.grad import VALUE_AND_GRAD
from autopar.frontend.tracer import trace
from autopar.inter_op.pipeline import layer_boundaries, slice_range, slice_stages, split_step
from autopar.inter_op.pipeshard import microbatch_args
from support.steps import BATCH, PARAMS, B, H  # four 16 x 16 layers, a batch of 8

L0, L1, L2, L3, X, Y = range(6)         # loss input positions: params (sorted keys), x, y


def marked_loss(p, x, y):
    """Four layers cut by markers; h0 skips layers 1 and 2; l0 is tied into layer 3; one aux
    output is made in layer 0."""
    h0 = jnp.tanh(x @ p["l0"])
    reg = jnp.mean(h0 ** 2)
    h0 = autopar.mark_stage_boundary(h0)
    h1 = autopar.mark_stage_boundary(jnp.tanh(h0 @ p["l1"]))
    h2 = autopar.mark_stage_boundary(jnp.tanh(h1 @ p["l2"]))
    out = (jnp.tanh(h2 @ p["l3"]) + h0) @ p["l0"].T
    err = out - y
    return jnp.mean(err ** 2), {"count": jnp.sum(err > 0), "reg": reg}


def make_step(loss_fn=marked_loss, vg=autopar.value_and_grad, has_aux=True):
    tx = optax.sgd(0.1)

    def step(params, batch):
        value, grads = vg(loss_fn, has_aux=has_aux)(params, batch["x"], batch["y"])
        return optax.apply_updates(params, tx.update(grads, tx.init(params))[0]), value
    return step


def loss_graph(step=None, num_microbatches=1):
    step = step or make_step()
    args = (PARAMS, BATCH)
    graph = trace(step, args, batch_argnums=(1,), keep_grad=True)
    micro = graph if num_microbatches == 1 else trace(
        step, microbatch_args(args, (1,), num_microbatches), batch_argnums=(1,), keep_grad=True)
    return split_step(graph, micro, num_microbatches)


@pytest.fixture(scope="module")
def loss():
    return loss_graph()


@pytest.fixture(scope="module")
def tensors(loss):
    """Forward tensor ids of h0, h1, h2 (the outputs of the first three tanh nodes)."""
    tanh = [n for n in loss.forward.nodes if n.primitive == "tanh"]
    return tuple(n.outputs[0] for n in tanh[:3])


# -- split_step -----------------------------------------------------------------------------

def test_split_step_finds_the_gradient_node_and_the_loss(loss):
    step, node = loss.step, loss.step.nodes[loss.grad_node]
    assert node.primitive == VALUE_AND_GRAD
    assert loss.num_diff == 4                  # the four parameter leaves
    assert loss.batch_inputs == {X, Y}
    assert loss.num_aux == 2                   # count and reg
    fwd = loss.forward
    assert len(fwd.inputs) == len(node.inputs) == 6
    assert [fwd.tensors[t].shape for t in fwd.inputs] == [(H, H)] * 4 + [(B, H)] * 2
    assert [fwd.tensors[t].dtype for t in fwd.outputs] == ["float32", "int32", "float32"]
    prims = [n.primitive for n in fwd.nodes]
    assert prims.count("dot_general") == 5     # forward only: no backward matmuls
    assert not any("transpose(" in n.name_stack for n in fwd.nodes)
    # The step's marker reads the parameters and batch inputs of the step.
    assert node.inputs == step.inputs[:6]


def test_split_step_at_the_microbatch_size():
    lg = loss_graph(num_microbatches=4)
    fwd = lg.forward
    shapes = [fwd.tensors[t].shape for t in fwd.inputs]
    assert shapes == [(H, H)] * 4 + [(B // 4, H)] * 2
    assert lg.batch_inputs == {X, Y}
    # the step graph itself keeps the full batch
    assert lg.step.tensors[lg.step.inputs[X]].shape == (B, H)


def test_split_step_rejects_a_microbatch_graph_of_another_size():
    step = make_step()
    args = (PARAMS, BATCH)
    graph = trace(step, args, batch_argnums=(1,), keep_grad=True)
    micro = trace(step, microbatch_args(args, (1,), 2), batch_argnums=(1,), keep_grad=True)
    with pytest.raises(autopar.InvalidArgumentError, match="num_microbatches=4"):
        split_step(graph, micro, 4)


@pytest.mark.parametrize("count", [0, 2])
def test_split_step_needs_exactly_one_gradient(count):
    def step(params, batch):
        loss = lambda p: marked_loss(p, batch["x"], batch["y"])[0]
        out = [autopar.value_and_grad(loss)(params) for _ in range(count)]
        return out or jax.value_and_grad(loss)(params)
    graph = trace(step, (PARAMS, BATCH), batch_argnums=(1,), keep_grad=True)
    with pytest.raises(autopar.InvalidArgumentError, match=f"exactly one .* found {count}"):
        split_step(graph, graph, 1)


def test_split_step_rejects_a_loss_output_that_is_an_input():
    def loss_fn(p, x, y):
        return jnp.mean((x @ p["l0"] - y) ** 2), x          # aux: the batch itself
    with pytest.raises(autopar.UnsupportedError, match="input or a constant"):
        loss_graph(make_step(loss_fn))


# -- layers ---------------------------------------------------------------------------------

def test_manual_layers_cut_at_the_markers(loss, tensors):
    fwd = loss.forward
    bounds = layer_boundaries(fwd, autopar.ManualLayerOption())
    assert len(bounds) == 5 and bounds[0] == 0 and bounds[-1] == len(fwd.nodes)
    assert bounds[1:-1] == tuple(m.position for m in fwd.stage_markers)
    # each marked value is made in the layer before its cut
    for t, cut in zip(tensors, bounds[1:-1]):
        assert fwd.tensors[t].producer < cut
    # every layer has exactly one of the four main matmuls (layer 3 also has the tied one)
    dots = [sum(n.primitive == "dot_general" for n in fwd.nodes[a:b])
            for a, b in zip(bounds, bounds[1:])]
    assert dots == [1, 1, 1, 2]


def test_manual_layers_need_markers():
    def plain(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["l0"]) @ p["l1"] - y) ** 2)
    lg = loss_graph(make_step(plain, has_aux=False))
    with pytest.raises(autopar.InvalidArgumentError, match="mark_stage_boundary"):
        layer_boundaries(lg.forward, autopar.ManualLayerOption())


@pytest.mark.parametrize("num_layers", [1, 2, 4])
def test_auto_layers(loss, num_layers):
    n = len(loss.forward.nodes)
    bounds = layer_boundaries(loss.forward, autopar.AutoLayerOption(num_layers=num_layers))
    assert len(bounds) == num_layers + 1
    assert bounds[0] == 0 and bounds[-1] == n
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    if num_layers > 1:      # FLOPs are balanced: no layer holds all five matmuls
        for a, b in zip(bounds, bounds[1:]):
            assert sum(nd.primitive == "dot_general" for nd in loss.forward.nodes[a:b]) < 5


def test_auto_layers_capped_at_the_operator_count(loss):
    n = len(loss.forward.nodes)
    bounds = layer_boundaries(loss.forward, autopar.AutoLayerOption(num_layers=n + 50))
    assert bounds == tuple(range(n + 1))      # one operator per layer


# -- stage slices ---------------------------------------------------------------------------

def test_stage_slices_with_a_skip_over_two_stages(loss, tensors):
    fwd = loss.forward
    h0, h1, h2 = tensors
    bounds = layer_boundaries(fwd, autopar.ManualLayerOption())
    s0, s1, s2, s3 = slice_stages(loss, list(zip(bounds, bounds[1:])))
    assert [s.index for s in (s0, s1, s2, s3)] == [0, 1, 2, 3]
    assert (s0.start, s3.stop) == (0, len(fwd.nodes))
    assert (s0.param_inputs, s1.param_inputs, s2.param_inputs, s3.param_inputs) == \
        ((L0,), (L1,), (L2,), (L0, L3))          # l0 is tied into the last stage
    assert (s0.data_inputs, s1.data_inputs, s2.data_inputs, s3.data_inputs) == \
        ((X,), (), (), (Y,))
    assert s0.act_inputs == ()
    assert s1.act_inputs == (h0,) and s2.act_inputs == (h1,)
    assert s3.act_inputs == tuple(sorted((h0, h2)))     # the skip arrives two stages later
    loss_out, count, reg = fwd.outputs
    assert set(s0.outputs) == {h0, reg}           # reg: a loss output made in stage 0
    assert s1.outputs == (h1,) and s2.outputs == (h2,)
    assert set(s3.outputs) == {loss_out, count}


def test_stage_slices_are_consistent(loss):
    """Every activation a stage reads is an output of an earlier stage; every loss output is
    an output of exactly one stage."""
    fwd = loss.forward
    for bounds in (layer_boundaries(fwd, autopar.ManualLayerOption()),
                   layer_boundaries(fwd, autopar.AutoLayerOption(num_layers=3))):
        stages = slice_stages(loss, list(zip(bounds, bounds[1:])))
        for st in stages:
            for t in st.act_inputs:
                p = fwd.tensors[t].producer
                (maker,) = [s for s in stages if s.start <= p < s.stop]
                assert maker.index < st.index and t in maker.outputs
            for t in st.outputs:
                assert st.start <= fwd.tensors[t].producer < st.stop
        for t in fwd.outputs:
            assert sum(t in st.outputs for st in stages) == 1


def test_whole_graph_as_one_stage(loss):
    fwd = loss.forward
    sl = slice_range(loss, 0, len(fwd.nodes), index=7)
    assert sl.index == 7
    assert sl.param_inputs == (L0, L1, L2, L3) and sl.data_inputs == (X, Y)
    assert sl.act_inputs == ()
    assert set(sl.outputs) == set(fwd.outputs)
    assert all(fwd.tensors[t].kind == TensorKind.INTERMEDIATE for t in sl.outputs)


def test_a_loss_input_made_with_broadcast_constants_is_split_into_microbatches():
    """`jnp.where(batch > 0, 1.0, 0.0)` computed in the step and passed to the loss: the
    broadcast 1 and 0 come from constants alone, so the mask still counts as batch data and
    gradient accumulation splits it (it was refused as 'not computed from batch_argnums')."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import autopar
    from support.steps import mesh_of

    def step(w, batch, vg=autopar.value_and_grad):
        mask = jnp.where(batch["x"][:, 0] > 0, 1.0, 0.0)

        def loss_fn(w, x, m):
            return jnp.mean(jnp.tanh(x @ w).sum(-1) * m)
        loss, g = vg(loss_fn)(w, batch["x"], mask)
        return w - 0.1 * g, loss
    w = jnp.ones((4, 4)) * 0.3
    batch = {"x": jax.random.normal(jax.random.key(0), (16, 4))}
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)),
                              method=autopar.ShardParallel(num_microbatches=2))
    got = par(w, batch)
    ref = jax.jit(lambda w, b: step(w, b, jax.value_and_grad))(w, batch)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-7)


def test_a_loss_input_made_from_the_batch_without_its_dimension_is_read_whole():
    """A token count computed in the step (`w.sum()`) and closed over by the loss has no batch
    dimension: it is not split (every microbatch reads the whole batch's), where it was
    refused; a [batch, ...] value made from the batch still is split."""
    def step(params, batch):
        w = jnp.where(batch["y"][:, 0] > 0, 1.0, 0.0)
        count = w.sum()

        def loss_fn(p, x, y):
            err = (jnp.tanh(x @ p["l0"]) - y) ** 2
            return jnp.sum(err.sum(-1) * w) / count
        loss, g = autopar.value_and_grad(loss_fn)(params, batch["x"], batch["y"])
        return g, loss
    lg = loss_graph(step, num_microbatches=2)
    fwd = lg.forward
    shapes = [fwd.tensors[t].shape for t in fwd.inputs]
    (w,), (count,) = ([q for q, s in enumerate(shapes) if s == shape] for shape in [(B // 2,), ()])
    assert shapes[X] == (B // 2, H)
    assert lg.batch_inputs == {X, Y, w} and count not in lg.batch_inputs
    assert [o.combine.value for o in lg.reduction.outputs] == ["sum"]
