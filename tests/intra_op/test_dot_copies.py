"""Matmul operands XLA reads through a layout copy (`intra_op.dot_copies`), and the memory
model's rule for the cheap values such a copy computes (`memory.memory_model`): a softmax's
probabilities in grouped-query attention are not kept from the forward to the backward."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from autopar.frontend.tracer import trace
from autopar.intra_op import dot_copies, memory
from autopar.intra_op.dot_copies import copied_operands

# (scores einsum, output einsum, projection of q, of k and v, q's heads, k's heads): GPT's
# multi-head attention and Gemma's grouped-query attention (autopar/models/gpt.py, gemma.py)
GPT = ("bqnd,bknd->bnqk", "bnqk,bknd->bqnd", "bsc,cnd->bsnd", "bsc,cnd->bsnd", (4,), (4,))
GQA = ("bqkgd,bskd->bkgqs", "bkgqs,bskd->bqkgd", "bsc,ckgd->bskgd", "bsc,ckd->bskd", (2, 2),
       (2,))


def _attention(case, grad: bool):
    scores, out, proj_q, proj_kv, q_heads, kv_heads = case

    def attend(x, wq, wk, wv):
        q, k, v = (jnp.einsum(spec, x, w) for spec, w in
                   ((proj_q, wq), (proj_kv, wk), (proj_kv, wv)))
        s = jnp.einsum(scores, q, k)
        e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
        p = e / e.sum(-1, keepdims=True)      # the backward reads e and the sums again
        return x + jnp.einsum(out, p, v).reshape(x.shape)

    def loss(x, wq, wk, wv):               # two layers: the first's buffers live through
        return jnp.sum(attend(attend(x, wq, wk, wv), wq, wk, wv) ** 2)   # the second's
    args = (jnp.ones((2, 16, 32)), jnp.ones((32, *q_heads, 8)), jnp.ones((32, *kv_heads, 8)),
            jnp.ones((32, *kv_heads, 8)))    # 4 heads of 8: the width of x
    return trace(jax.value_and_grad(loss, argnums=(1, 2, 3)) if grad else loss, args)


def _probs(graph):
    """The softmax's output: the division the attention's output matmul reads."""
    return next(t for n in graph.nodes if n.primitive == "dot_general" for t in n.inputs
                if graph.tensors[t].producer is not None
                and graph.nodes[graph.tensors[t].producer].primitive == "div")


@pytest.mark.parametrize("case, copied", [(GPT, False), (GQA, True)])
def test_the_probabilities_are_copied_only_where_xla_canonicalizes_the_matmul(case, copied):
    """GPT's `bnqk,bknd->bqnd` reads the probabilities as they are (one contracting and one
    free dimension behind the batch ones: XLA folds the transposition into the matmul);
    grouped-query `bkgqs,bskd->bqkgd` has two free dimensions, so XLA transposes them behind
    the contracting one, in a copy (`copy_bitcast_fusion` in the compiled Gemma step)."""
    graph = _attention(case, grad=False)
    p = _probs(graph)
    readers = [n for n in graph.nodes if n.primitive == "dot_general" and p in n.inputs]
    assert len(readers) == 1
    assert copied_operands(graph, readers[0])[readers[0].inputs.index(p)] is copied


def test_canonical_and_foldable_matmuls_copy_nothing():
    """A plain matmul, a batched one with its batch leading, and a weight read transposed
    (a swap XLA's transpose folding takes) are not copied."""
    for fn, shapes in [(lambda a, b: a @ b, ((8, 4), (4, 3))),
                       (lambda a, b: jnp.einsum("bij,bjk->bik", a, b), ((2, 8, 4), (2, 4, 3))),
                       (lambda a, b: a @ b.T, ((8, 4), (3, 4)))]:
        graph = trace(fn, tuple(jnp.ones(s) for s in shapes))
        dot = next(n for n in graph.nodes if n.primitive == "dot_general")
        assert copied_operands(graph, dot) == (False, False)


def test_gqa_probabilities_are_written_late_and_lower_the_peak(monkeypatch):
    """With the gradient: the grouped-query probabilities are written just before the
    backward matmul that reads them (`MemoryModel.late`), not kept from the forward: the peak
    drops by at most their bytes. GPT's are kept (no rule applies, same peak)."""
    for case, applies in ((GQA, True), (GPT, False)):
        graph = _attention(case, grad=True)
        model = memory.memory_model(graph)
        specs = [tuple(() for _ in t.shape) for t in graph.tensors]     # replicated
        with_rule = memory.peak_bytes(graph, specs, (1, 1))
        late = dict(model.late)
        assert bool(late) is applies
        if applies:
            p = next(iter(late))
            assert p == _probs(graph) and graph.tensors[p].shape == (2, 2, 2, 16, 16)
            assert model.pos[late[p]] > model.pos[graph.tensors[p].producer]
        monkeypatch.setattr(dot_copies, "recomputed_in_copies", lambda *a: {})
        monkeypatch.setattr(memory, "recomputed_in_copies", lambda *a: {})
        memory._CACHE.clear()
        without = memory.peak_bytes(graph, specs, (1, 1))
        monkeypatch.undo()
        memory._CACHE.clear()
        if applies:
            assert 0 < without - with_rule <= graph.tensors[p].nbytes
        else:
            assert without == with_rule


def test_a_value_only_a_copy_reads_is_left_where_recomputing_it_would_extend_its_inputs():
    """Forward only: the grouped-query probabilities are read by the copy of one matmul and
    by nothing else. Computing them in the copy would keep the exponentials (read only to
    make them) alive up to that matmul, so the rule leaves the model as it is."""
    graph = _attention(GQA, grad=False)
    plain, _, copies, _ = memory._memory_model(graph, ())
    assert _probs(graph) in copies                        # a candidate of the rule
    assert memory.memory_model(graph) == plain and not plain.late
