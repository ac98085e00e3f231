"""The batch dimension of every value of a traced step (`intra_op.batch_dims`)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from autopar.frontend.tracer import trace
from autopar.intra_op.batch_dims import batch_dims, batch_sources


def _dims_by_primitive(graph, dims, primitive):
    return [dims[n.outputs[0]] for n in graph.nodes if n.primitive == primitive]


def test_mlp_step_activations_batched_gradients_and_loss_not():
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)
    w, x = jnp.ones((8, 4)), jnp.ones((16, 8))
    g = trace(jax.value_and_grad(loss), (w, x), batch_argnums=(1,))
    dims = batch_dims(g)
    assert batch_sources(g) == {g.inputs[1]: 0}
    assert dims[g.inputs[0]] is None and dims[g.inputs[1]] == 0
    dots = [n for n in g.nodes if n.primitive == "dot_general"]
    by_shape = {g.tensors[n.outputs[0]].shape: dims[n.outputs[0]] for n in dots}
    assert by_shape[(16, 4)] == 0            # forward activation keeps the batch
    grad = by_shape.get((8, 4), by_shape.get((4, 8), "missing"))
    assert grad is None                       # the weight gradient contracts it away
    assert all(dims[t] is None for t in g.outputs)   # loss and gradient


def test_attention_reshapes_and_transposes_keep_the_batch_where_it_moves():
    def f(x):
        b, t, h = x.shape
        q = x.reshape(b, t, 2, h // 2).transpose(0, 2, 1, 3)      # [B, heads, T, d]
        s = jnp.einsum("bhqd,bhkd->bhqk", q, q)
        flat = s.transpose(2, 1, 0, 3).reshape(t, 2 * b * t)      # batch no longer major
        return s.sum(), flat, x.reshape(b * t, h)
    g = trace(f, (jnp.ones((4, 6, 8)),), batch_argnums=(0,))
    dims = batch_dims(g)
    _, flat, merged = g.outputs
    assert dims[merged] == 0                                    # [B*T, H]: B is major
    assert dims[flat] is None                                    # [T, 2*B*T]: B is minor
    assert _dims_by_primitive(g, dims, "dot_general") == [0]     # batch dim of the einsum
    transposes = [n for n in g.nodes if n.primitive == "transpose"]
    assert dims[transposes[0].outputs[0]] == 0 and dims[transposes[1].outputs[0]] == 2


def test_conv_pool_embedding_and_cross_entropy():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, tokens, images):
            e = nn.Embed(32, 8)(tokens)                               # gather: batch kept
            c = nn.Conv(4, (3, 3))(images)
            return e.mean(axis=1), c.mean(axis=(1, 2))

    tokens, images = jnp.zeros((4, 5), jnp.int32), jnp.ones((4, 6, 6, 3))
    params = Net().init(jax.random.key(0), tokens, images)

    def loss(p, tokens, images, labels):
        e, c = Net().apply(p, tokens, images)
        logits = jnp.concatenate([e, c], axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    g = trace(jax.grad(loss), (params, tokens, images, jnp.zeros((4,), jnp.int32)),
              batch_argnums=(1, 2, 3))
    dims = batch_dims(g)
    assert _dims_by_primitive(g, dims, "gather")[0] == 0
    convs = [n for n in g.nodes if n.primitive == "conv_general_dilated"]
    assert dims[convs[0].outputs[0]] == 0                        # forward conv
    assert dims[convs[-1].outputs[0]] is None                   # kernel gradient
    # the embedding gradient scatters per-example rows into the shared table
    adds = [n for n in g.nodes if n.primitive == "scatter-add"]
    assert any(dims[n.outputs[0]] is None and g.tensors[n.outputs[0]].shape == (32, 8)
               for n in adds)
    # take_along_axis's transpose scatters along a batching dimension: still per example
    assert any(dims[n.outputs[0]] == 0 for n in adds)
    assert all(dims[t] is None for t in g.outputs)


def test_sources_seed_other_dimensions():
    g = trace(lambda x: jnp.swapaxes(x, 0, 1) * 2.0, (np.ones((3, 4), np.float32),))
    dims = batch_dims(g, {g.inputs[0]: 1})
    assert dims[g.outputs[0]] == 0
    assert batch_dims(g)[g.outputs[0]] is None                   # no batch argument


def test_the_batch_goes_through_loop_slices_stacks_and_carries():
    """A scan over time steps of a [T, B, D] batch: the slice's batch is dim 0, the carry
    keeps the init's, the stacked ys have it at dim 1 again; the weight gradient none."""
    def loss(w, xs, h0):
        def cell(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h
        h, ys = jax.lax.scan(cell, h0, xs)
        return jnp.mean(ys ** 2) + jnp.mean(h)
    w, xs, h0 = jnp.ones((8, 8)), jnp.ones((5, 16, 8)), jnp.ones((16, 8))
    g = trace(jax.grad(loss), (w, xs, h0), batch_argnums=(1, 2))
    dims = batch_dims(g, {g.inputs[1]: 1, g.inputs[2]: 0})
    by = lambda p: _dims_by_primitive(g, dims, p)          # noqa: E731
    assert set(by("loop_slice")) >= {0} and 0 in by("loop_carry")
    assert 1 in by("loop_stack")
    assert dims[g.outputs[0]] is None                     # dL/dw
