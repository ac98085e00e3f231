"""Where nodes run in XLA's schedule, from the graph alone (`autopar.intra_op.phases`)."""
import jax
import jax.numpy as jnp

from autopar.frontend.tracer import trace
from autopar.intra_op.phases import deferred_nodes, sibling_reductions, tail_nodes


def test_sibling_reductions_pay_one_latency():
    def f(x):
        m = x.mean(0)
        m2 = (x * x).mean(0)           # independent of m: combined with it by XLA
        return (x - m).sum(0) / m2     # depends on m: not a sibling
    g = trace(f, (jnp.ones((8, 4)),))
    reds = [n.id for n in g.nodes if n.primitive == "reduce_sum"]
    assert len(reds) == 3
    assert sibling_reductions(g) == frozenset({reds[1]})


def test_tail_is_what_no_matmul_follows():
    """The weight-gradient matmuls and the update are the tail (no matmul reads what they
    compute); the forward matmuls and the activation gradient (read by the first layer's
    weight-gradient matmul) are not."""
    def step(w1, w2, x):
        def loss(w1, w2):
            return jnp.tanh(jnp.tanh(x @ w1) @ w2).sum()
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2
    g = trace(step, (jnp.ones((4, 8)), jnp.ones((8, 2)), jnp.ones((16, 4))))
    tail = tail_nodes(g)
    dots = [n for n in g.nodes if n.primitive == "dot_general"]
    assert len(dots) == 5           # 2 forward, 1 activation gradient, 2 weight gradients
    assert [d.id in tail for d in dots[:2]] == [False, False]
    assert sum(d.id in tail for d in dots) == 2
    assert g.nodes[-1].id in tail                                   # the update
    assert tail <= deferred_nodes(g)

