"""The user's own `jax.checkpoint` (`nnx.remat`, `nn.remat`) under a stock gradient: on XLA:CPU,
which drops optimization barriers before it schedules, the recomputation is tied to the
cotangent JAX's barrier waits for (`step_remat.user_remats`), its PRNG keys too, so XLA can
neither run it early nor merge its random bits with the forward pass's."""
import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.core.enums import Remat
from autopar.frontend.interpret import interpret
from autopar.frontend.tracer import trace
from autopar.inter_op.step_remat import StepRemat, forward_nodes, rematerialize, user_remats
from support.steps import mesh_of


def _block(w, x, key, i):
    key = jax.random.fold_in(key, i)          # inside the checkpoint, as nnx.Dropout draws
    h = jax.nn.gelu(x @ w[0])
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    return x + jnp.where(keep, h / 0.9, 0.0) @ w[1]


def _step_of(value_and_grad, boundary: bool = False):
    """A training step over three checkpointed blocks (with `boundary`, a pipeline stage
    boundary after the second)."""
    def step(ws, key, x):
        def loss(ws):
            h = x
            for i, w in enumerate(ws):
                h = jax.checkpoint(_block, static_argnums=(3,))(w, h, key, i)
                if boundary and i == 1:
                    h = autopar.mark_stage_boundary(h)
            return jnp.mean(h ** 2)
        value, grads = value_and_grad(loss)(ws)
        return value, [(a - 0.1 * ga, b - 0.1 * gb) for (a, b), (ga, gb) in zip(ws, grads)]
    return step


_step = _step_of(jax.value_and_grad)
_pipeline_step = _step_of(autopar.value_and_grad, boundary=True)


def _args():
    k = jax.random.split(jax.random.key(0), 7)
    ws = [(jax.random.normal(k[2 * i], (16, 32)) * 0.3,
           jax.random.normal(k[2 * i + 1], (32, 16)) * 0.3) for i in range(3)]
    return ws, jax.random.key(7), jax.random.normal(k[6], (8, 16))


def _threefry_loops(hlo: str) -> int:
    """The while loops XLA:CPU draws the (8, 32) masks' bits in (two uint32 words carried)."""
    return len(re.findall(r"= \(s32\[\], u32\[8,32\]\{[^}]*\}, u32\[8,32\].* while\(", hlo))


def test_tied_checkpoints_compute_the_same_bits_and_draw_their_masks_again():
    ws, key, x = _args()
    graph = trace(_step, (ws, key, x), batch_argnums=(2,))
    assert len(user_remats(graph)) == 3
    tied = rematerialize(graph, StepRemat(boundaries=(0, len(forward_nodes(graph))),
                                          choices=(Remat.NONE,)))
    assert sum(n.primitive == "reduce_max" for n in tied.nodes) == \
        sum(n.primitive == "reduce_max" for n in graph.nodes) + 3    # one tie per checkpoint
    flat = jax.tree_util.tree_leaves((ws, key, x))
    run = [jax.jit(lambda *f, g=g: interpret(g, f)) for g in (graph, tied)]
    for a, b in zip(run[0](*flat), run[1](*flat)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    untied = _threefry_loops(run[0].lower(*flat).compile().as_text())
    loops = _threefry_loops(run[1].lower(*flat).compile().as_text())
    # Untied, XLA merges each recomputed mask with the forward's (one draw per block, its two
    # words kept to the backward); tied, each checkpoint draws its mask again.
    assert (untied, loops) == (3, 6)


def test_a_step_with_checkpoints_plans_the_tie_and_trains_like_jit():
    ws, key, x = _args()
    par = autopar.parallelize(_step, mesh=mesh_of((2, 4)), batch_argnums=(2,))
    plan = par.get_plan(ws, key, x)
    assert plan.remat["layers"] == ["none"] and plan.remat["tied"]
    assert "the step's own jax.checkpoint" in autopar.dump(plan)
    ref = got = ws
    for i in range(2):
        xi = x + i
        (lr, ref), (lg, got) = jax.jit(_step)(ref, key, xi), par(got, key, xi)
        np.testing.assert_allclose(lg, lr, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_without_checkpoints_the_step_is_planned_as_written():
    def step(w, x):
        value, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return value, w - 0.1 * g
    w, x = jnp.ones((16, 16)), jnp.ones((8, 16))
    graph = trace(step, (w, x), batch_argnums=(1,))
    assert user_remats(graph) == []
    plan = autopar.parallelize(step, mesh=mesh_of((2, 4)), batch_argnums=(1,)).get_plan(w, x)
    assert not plan.remat


def test_a_cached_plan_whose_rewrite_no_longer_matches_is_planned_again(tmp_path, caplog):
    """A plan-cache entry written by other code of the same autopar version (a development
    checkout) whose recorded rewrite no longer matches the step's is re-planned, with a
    warning, instead of failing the call."""
    ws, key, x = _args()
    autopar.parallelize(_step, mesh=mesh_of((2, 4)), batch_argnums=(2,),
                        plan_cache=tmp_path).get_plan(ws, key, x)
    (entry,) = tmp_path.glob("plan-*.json")
    text = entry.read_text()
    recorded = json.loads(text)["plan"]["remat"]["graph_fingerprint"]
    entry.write_text(text.replace(recorded, "0" * len(recorded)))
    par = autopar.parallelize(_step, mesh=mesh_of((2, 4)), batch_argnums=(2,),
                              plan_cache=tmp_path)
    with caplog.at_level(logging.WARNING, logger="autopar.passes"):
        got, _ = par(ws, key, x)
    assert "does not match this step; re-planning" in caplog.text
    np.testing.assert_allclose(got, jax.jit(_step)(ws, key, x)[0], rtol=1e-6)


@pytest.mark.filterwarnings("ignore:PipeshardParallel\\(num_microbatches=1\\)")
def test_pipeline_stages_tie_the_users_checkpoints_and_train_like_jit():
    """A stage's training graph ties the checkpoints inside it as a single-mesh step does
    (its backward executable recomputes each block after the cotangent that block waits for),
    and the pipeline trains like jax.jit. (The key is a raw uint32 key: typed keys do not
    cross pipeline stages yet, issue 25.)"""
    from autopar.inter_op.pipeline import layer_boundaries, slice_range, split_step
    from autopar.inter_op.stage_solver import StageSolver
    ws, _, x = _args()
    key = jax.random.PRNGKey(7)
    # One microbatch: a microbatch's dropout masks are not the batch's yet (issue 25).
    method = autopar.PipeshardParallel(num_microbatches=1,
                                       layer_option=autopar.ManualLayerOption(),
                                       stage_option=autopar.UniformStageOption(num_stages=2))
    graph = trace(_pipeline_step, (ws, key, x), batch_argnums=(2,), keep_grad=True)
    loss = split_step(graph, graph, 1)
    bounds = tuple(layer_boundaries(loss.forward, method.layer_option))
    solver = StageSolver(loss, autopar.ClusterSpec.preset("cpu"), method, bounds)
    sl = slice_range(loss, bounds[0], bounds[1], 0)
    tied, raw = solver.graph(sl)[0], solver.traces[(sl.start, sl.stop)]
    assert len(user_remats(raw)) == 2
    assert sum(n.primitive == "reduce_max" for n in tied.nodes) > \
        sum(n.primitive == "reduce_max" for n in raw.nodes)
    par = autopar.parallelize(_pipeline_step, mesh=mesh_of((2, 4)), batch_argnums=(2,),
                              method=method)
    ref = got = ws
    for i in range(2):
        (lr, ref), (lg, got) = jax.jit(_pipeline_step)(ref, key, x + i), par(got, key, x + i)
        np.testing.assert_allclose(lg, lr, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
