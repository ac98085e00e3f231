"""Loops are planned, not replicated (frontend/loops.py, intra_op/loops.py, lowering/loops.py).

`scan` (and `nn.scan` / `nnx.scan` / static `fori_loop`, which are scans), `while_loop` and
`cond` bodies are traced into the OpGraph; their operators get ILP strategies priced per
iteration, and the lowering re-emits the loop with per-iteration sharding constraints. Each
case is checked against plain `jax.jit` on one device (fp32) on a 2x4 mesh.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autopar
from autopar.core.graph import LoopKind
from autopar.cost import hlo
from autopar.frontend.tracer import trace
from autopar.intra_op.predict import compare
from autopar.models.gpt import GPTConfig
from support.steps import assert_equivalent, make_case, mesh_of, run_steps, sgd_momentum_clip

L, D, B = 3, 32, 16
KEY = jax.random.key(0)
BATCHES = [{"x": jax.random.normal(jax.random.fold_in(KEY, i), (B, D)),
            "y": jax.random.normal(jax.random.fold_in(KEY, 10 + i), (B, D))} for i in range(3)]
TX = sgd_momentum_clip()


def scanned_mlp(p, x):
    def body(h, wb):
        w, b = wb
        return jnp.tanh(h @ w + b), None
    return jax.lax.scan(body, x, (p["ws"], p["bs"]))[0]


def unrolled_mlp(p, x):
    for i in range(L):
        x = jnp.tanh(x @ p[f"w{i}"] + p[f"b{i}"])
    return x


def make_step(apply):
    def step(state, batch):
        params, opt = state
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((apply(p, batch["x"]) - batch["y"]) ** 2))(params)
        updates, opt = TX.update(g, opt, params)
        return (optax.apply_updates(params, updates), opt), loss, g
    return step


def stacked_params():
    return {"ws": jax.random.normal(KEY, (L, D, D)) * 0.3, "bs": jnp.zeros((L, D))}


def check(step, state, batches=BATCHES, mesh=(2, 4)):
    ref = run_steps(jax.jit(step), state, batches)
    par = autopar.parallelize(step, mesh=mesh_of(mesh), batch_argnums=(1,))
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=True, smooth=True)
    return par


# ------------------------------------------------------------------------------ trace
def test_trace_makes_a_region_per_scan_with_boundary_pseudo_nodes():
    p = stacked_params()
    g = trace(jax.grad(lambda p, x: jnp.mean(scanned_mlp(p, x) ** 2)), (p, BATCHES[0]["x"]))
    fwd, bwd = g.regions
    assert fwd.kind is bwd.kind is LoopKind.SCAN and fwd.trips == bwd.trips == L
    prims = [n.primitive for n in g.nodes[fwd.start:fwd.stop]]
    assert prims[:3] == ["loop_carry", "loop_slice", "loop_slice"]
    assert "dot_general" in prims and prims[-1] == "loop_stack"
    assert "loop_exit" in prims and "scan" not in [n.primitive for n in g.nodes]
    body = range(*fwd.body_nodes[0])
    trips = g.node_trips()
    assert all(trips[n] == L for n in body) and trips[fwd.entry_nodes[0]] == 1
    matmul = 2 * B * D * D
    assert g.total_flops >= 3 * L * matmul          # forward, input and weight gradients x L
    # the stacked weights are sliced, one [D, D] matrix per iteration
    w_slice = g.nodes[fwd.entry_nodes[1]]
    assert g.tensors[w_slice.outputs[0]].shape == (D, D)
    # a value read inside the loop lives until the loop ends
    assert g.last_use()[w_slice.inputs[0]] >= fwd.stop - 1


def test_liveness_holds_stacked_ys_through_the_loop():
    """A body value lives one iteration; the stacked ys buffer exists from the loop's start,
    so the peak inside the body counts it next to the body's temporaries."""
    from autopar.core.spec import replicated
    from autopar.intra_op.solve import peak_memory
    xs, c0 = jnp.ones((4, 64, 64)), jnp.ones((64, 64))

    def f(xs, c0):
        def body(c, x):
            h = jnp.tanh(c @ x)
            return h, h * 2.0
        return jax.lax.scan(body, c0, xs)
    g = trace(f, (xs, c0))
    specs = [replicated(t.rank) for t in g.tensors]
    block = 64 * 64 * 4
    # xs and ys whole, plus the carry, the matmul, tanh and the y of one iteration
    assert peak_memory(g, specs, (2, 4)) >= 2 * 4 * block + 4 * block


# ------------------------------------------------------------------------------ scan
def test_lax_scan_mlp_equivalence_and_per_iteration_costs():
    state = (stacked_params(), TX.init(stacked_params()))
    par = check(make_step(scanned_mlp), state)
    plan = par.get_plan(state, BATCHES[0])
    assert not plan.fallbacks                      # nothing replicated as control flow
    for t in plan.inputs:                          # the layer dimension is never split
        if t.shape[:1] == (L,):
            assert t.spec[0] == (), (t.path, t.spec)
    # The body's operators are solved once and costed x L: about the unrolled twin's compute
    # (jax 0.10 also computes the first layer's input gradient, which the unrolled step skips:
    # 9/8 of it; jax 0.12 drops one matmul of the scanned backward: 15/16), never 1/L of it.
    unrolled = {f"w{i}": stacked_params()["ws"][i] for i in range(L)}
    unrolled.update({f"b{i}": stacked_params()["bs"][i] for i in range(L)})
    u_state = (unrolled, TX.init(unrolled))
    u_plan = autopar.parallelize(make_step(unrolled_mlp), mesh=mesh_of((2, 4)),
                                 batch_argnums=(1,)).get_plan(u_state, BATCHES[0])
    matmuls = lambda pl: sum(o.compute_s for o in pl.operators if o.primitive == "dot_general")
    assert 0.9 * matmuls(u_plan) <= matmuls(plan) <= 1.15 * matmuls(u_plan)


class _Block(nnx.Module):
    def __init__(self, d, rngs):
        self.linear = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return nnx.gelu(self.linear(x))


class _ScanMLP(nnx.Module):
    """The Flax docs' scan over layers: `nnx.vmap` makes stacked layers, `nnx.scan` applies."""

    def __init__(self, d, num_layers, rngs):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs):
            return _Block(d, rngs)
        self.blocks = create_block(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)
        return forward(x, self.blocks)


def test_nnx_scan_mlp_equivalence():
    graphdef, params = nnx.split(_ScanMLP(D, L, nnx.Rngs(0)), nnx.Param)
    step = make_step(lambda p, x: nnx.merge(graphdef, p)(x))
    par = check(step, (params, TX.init(params)))
    graph = par.get_graph((params, TX.init(params)), BATCHES[0])
    assert [r.trips for r in graph.regions] == [L, L]


def test_scanned_gpt_is_planned_inside_the_loop():
    """nn.scan over GPT blocks: equivalent, Megatron/DP collectives inside the while bodies
    and far less temp memory per device than one device's (a replicated loop holds it all)."""
    cfg = GPTConfig(vocab_size=128, seq_len=16, num_layers=2, hidden=64, num_heads=4,
                    scan_layers=True)
    step, state, batches = make_case("gpt", "linen", TX, gpt_config=cfg, batch_size=8)
    par = check(step, state, batches)
    plan = par.get_plan(state, batches[0])
    stacked = [t for t in plan.inputs if "blocks" in t.path and t.role == "param"]
    assert stacked and all(t.spec[0] == () for t in stacked)
    assert any(any(d for d in t.spec) for t in stacked)     # sharded on non-layer dims
    compiled = par.get_compiled(state, batches[0])
    in_body = hlo.summary(hlo.loop_body_collectives(compiled.as_text()))
    assert in_body.get("all-reduce", (0,))[0] >= 2, in_body
    # the plan predicts what compiles (body collectives listed once, as the HLO has them)
    predicted = compare(plan.collectives, hlo.collectives(compiled.as_text()),
                        reduce_scatter_as_all_reduce=True)
    assert predicted.ok, predicted.problems
    one = jax.jit(step).lower(state, batches[0]).compile().memory_analysis()
    assert compiled.memory_analysis().temp_size_in_bytes < 0.3 * one.temp_size_in_bytes


# ----------------------------------------------------------------- fori, while, cond
W = jax.random.normal(KEY, (D, D)) * 0.3


def test_static_fori_loop_equivalence():
    def step(w, batch):
        def loss(w):
            h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w) + i, batch["x"])
            return jnp.mean((h - batch["y"]) ** 2)
        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value, g
    par = check(step, W)
    assert [r.kind for r in par.get_graph(W, BATCHES[0]).regions] == [LoopKind.SCAN] * 2


def test_while_loop_with_dynamic_bound_equivalence():
    def power(w, x, n):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w)
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]
    par = autopar.parallelize(power, mesh=mesh_of((2, 4)), batch_argnums=(1,))
    x = BATCHES[0]["x"]
    for n in (0, 3):
        np.testing.assert_allclose(par(W, x, jnp.int32(n)), jax.jit(power)(W, x, jnp.int32(n)),
                                   rtol=1e-5, atol=1e-6)
    graph = par.get_graph(W, x, jnp.int32(3))
    assert [(r.kind, r.trips) for r in graph.regions] == [(LoopKind.WHILE, 1)]   # unknown
    assert "dot_general" in [n.primitive for n in graph.nodes]


def test_fingerprint_sees_a_while_loops_condition():
    from autopar.core.plan import graph_fingerprint
    x = BATCHES[0]["x"]
    fp = lambda n: graph_fingerprint(trace(lambda x: jax.lax.while_loop(   # noqa: E731
        lambda c: jnp.sum(c) < n, lambda c: c * 2.0, x), (x,)))
    assert fp(10.0) != fp(20.0) and fp(10.0) == fp(10.0)


@pytest.mark.parametrize("loop,trips", [
    (lambda x: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, jnp.tanh(c[1] @ W)),
                                  (0, x))[1], 5),
    (lambda x: jax.lax.while_loop(lambda c: 0 < c[0], lambda c: (c[0] - 2, jnp.tanh(c[1] @ W)),
                                  (7, x))[1], 4),
    (lambda x: jax.lax.fori_loop(2, jnp.int32(9), lambda i, h: jnp.tanh(h @ W), x), 7),
    (lambda x: jax.lax.while_loop(lambda h: jnp.sum(h) < 10.0, lambda h: h * 2.0, x), 1),
])
def test_a_counting_while_loop_is_costed_per_iteration(loop, trips):
    x = jnp.abs(BATCHES[0]["x"])
    assert [r.trips for r in trace(loop, (x,)).regions] == [trips]
    par = autopar.parallelize(loop, mesh=mesh_of((2, 4)), batch_argnums=(0,))
    np.testing.assert_allclose(par(x), jax.jit(loop)(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cond_equivalence_both_branches(sign):
    def step(w, batch):
        def loss(w):
            h = batch["x"] @ w
            h = jax.lax.cond(jnp.sum(batch["x"]) > 0, lambda h: jnp.tanh(h @ w),
                             lambda h: h * 2.0, h)
            return jnp.mean((h - batch["y"]) ** 2)
        value, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, value, g
    batches = [{"x": sign * jnp.abs(b["x"]), "y": b["y"]} for b in BATCHES]
    par = check(step, W, batches)
    graph = par.get_graph(W, batches[0])
    assert [r.kind for r in graph.regions] == [LoopKind.COND] * 2
    exits = [n for n in graph.nodes if n.primitive == "branch_exit"]
    assert exits and all(len(n.inputs) == 2 for n in exits)    # one sharding for both


# ------------------------------------------------------------------- methods, pipelines
@pytest.mark.parametrize("method", [autopar.DataParallel, autopar.Zero3Parallel])
def test_scanned_stack_under_data_parallel_and_zero3(method):
    """The batch path is followed through slices, stacks and carries (DataParallel pins it);
    ZeRO-3 shards the stacks (and their Adam moments) on a non-layer dim even where the
    layer dim is the largest, and gathers each layer's slice inside the loop."""
    n, d = 8, 8                                    # the layer dim is the largest
    p = {"ws": jax.random.normal(KEY, (n, d, d)) * 0.5}
    batches = [{"x": b["x"][:, :d], "y": b["y"][:, :d]} for b in BATCHES]
    tx = optax.adam(1e-2)

    def step(state, batch):
        params, opt = state
        loss, g = jax.value_and_grad(lambda q: jnp.mean((jax.lax.scan(
            lambda h, w: (jnp.tanh(h @ w), None), batch["x"], q["ws"])[0] - batch["y"]) ** 2)
        )(params)
        updates, opt = tx.update(g, opt, params)
        return (optax.apply_updates(params, updates), opt), loss, g
    state = (p, tx.init(p))
    ref = run_steps(jax.jit(step), state, batches)
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method(), batch_argnums=(1,))
    assert_equivalent(ref, run_steps(par, state, batches), compare_params=False,   # Adam
                      smooth=True)
    plan = par.get_plan(state, batches[0])
    stacks = [t for t in plan.inputs if t.shape == (n, d, d)]
    assert len(stacks) == 3 and all(t.spec[0] == () for t in stacks)
    body = hlo.summary(hlo.loop_body_collectives(par.get_compiled(state, batches[0]).as_text()))
    if method is autopar.Zero3Parallel:
        assert all(any(t.spec) for t in stacks)
        assert body.get("all-gather", (0,))[0] >= 1, body
    else:
        assert not any(any(t.spec) for t in stacks)
        assert set(body) <= {"all-reduce"}, body     # only the gradient reduction


def test_pipeline_cuts_a_scanned_stack_into_sub_scans():
    """AutoLayerOption runs a scan as sub-scans over ranges of its layers (frontend/subscans):
    layer clustering cuts between them (never inside a loop region), so the stack spans both
    stages, and the pipeline is exact."""
    p = {"w_in": jax.random.normal(KEY, (D, D)) * 0.3, **stacked_params(),
         "w_out": jax.random.normal(jax.random.fold_in(KEY, 7), (D, D)) * 0.3}

    def step(state, batch):
        def loss(q):
            h = jnp.tanh(batch["x"] @ q["w_in"])
            with jax.named_scope("stack"):
                h = scanned_mlp(q, h)
            return jnp.mean((jnp.tanh(h @ q["w_out"]) - batch["y"]) ** 2)
        value, g = autopar.value_and_grad(loss)(state[0])
        return (jax.tree.map(lambda a, b: a - 0.1 * b, state[0], g),), value, g
    ref = run_steps(jax.jit(step), (p,), BATCHES)
    method = autopar.PipeshardParallel(
        num_microbatches=2, layer_option=autopar.AutoLayerOption(num_layers=3),
        stage_option=autopar.UniformStageOption(num_stages=2))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)
    assert_equivalent(ref, run_steps(par, (p,), BATCHES), compare_params=True, rtol=2e-5,
                      smooth=True)
    plan = par.get_plan((p,), BATCHES[0])
    assert len(plan.stages) == 2
    assert all(any("stack" in x for x in s.scopes) for s in plan.stages), plan.stages


def test_sub_scans_compute_the_scan():
    from autopar.frontend.subscans import piece_bounds, split_scans
    assert piece_bounds(10, 4) == [0, 2, 5, 7, 10] and piece_bounds(3, 8) == [0, 1, 2, 3]

    def f(ws, x):
        body = lambda h, w: (jnp.tanh(h @ w), jnp.sum(h))                   # noqa: E731
        h, ys = jax.lax.scan(body, x, ws)
        return (h, ys) + jax.lax.scan(body, h, ws, reverse=True)
    ws = jax.random.normal(KEY, (6, D, D)) * 0.3
    x = BATCHES[0]["x"]
    split = split_scans(jax.make_jaxpr(f)(ws, x), 4)
    for a, b in zip(f(ws, x), split(ws, x)):
        np.testing.assert_array_equal(a, b)
    trips = [r.trips for r in trace(split, (ws, x)).regions]
    assert len(trips) == 8 and sum(trips) == 12              # 4 pieces of each 6-layer scan


def test_scanned_gpt_gets_its_unrolled_twins_plan():
    """Planned (not compiled) at a size where Megatron pays: every block operator of the
    scanned GPT takes the strategy the unrolled twin gives it in its first block, and the
    predicted step costs agree."""
    from flax.training import train_state

    from autopar.models.gpt import GPT, gpt_loss, make_gpt_batch

    def plan_of(scan):
        cfg = GPTConfig(vocab_size=1024, seq_len=64, num_layers=2, hidden=256, num_heads=8,
                        scan_layers=scan)
        net, batch = GPT(cfg), make_gpt_batch(KEY, 16, cfg)
        state = jax.eval_shape(lambda: train_state.TrainState.create(
            apply_fn=net.apply, params=net.init(KEY, batch["tokens"]), tx=optax.adamw(1e-3)))

        def step(state, batch):
            loss, g = jax.value_and_grad(lambda p: gpt_loss(
                state.apply_fn(p, batch["tokens"]), batch["tokens"]))(state.params)
            return state.apply_gradients(grads=g), loss
        return autopar.plan(step, state, batch, cluster=autopar.ClusterSpec.preset("cpu"),
                            mesh_shape=(2, 4), batch_argnums=(1,))

    def block_strategies(plan):
        out = {}
        for o in plan.operators:
            scope = o.name_stack.replace("blocks/block", "block").replace("block_0", "block")
            if "/block/" in scope:      # which dim a square gradient reduce-scatters onto
                out.setdefault((scope, o.out_shape), re.sub(r" rs\d$", " rs", o.strategy))
        return out                        # is a tie between equal costs
    scanned, unrolled = plan_of(True), plan_of(False)
    assert {o.trips for o in scanned.operators if "/blocks/" in o.name_stack} == {2}
    mine, twin = block_strategies(scanned), block_strategies(unrolled)
    assert len(mine) >= 10 and mine == twin
    assert any("model" in s for s in mine.values())          # tensor parallel inside
    # Within 5%: under the fusion-aware costs the scan's carry and its sliced weights cross
    # the loop boundary through memory (XLA's while loop materializes them every iteration),
    # where the unrolled twin fuses the residual stream into the next block's first kernel.
    assert scanned.predicted_compute_s == pytest.approx(unrolled.predicted_compute_s, rel=0.05)
    assert scanned.predicted_comm_s == pytest.approx(unrolled.predicted_comm_s, rel=0.02)
