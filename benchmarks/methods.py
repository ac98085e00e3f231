"""Method promises: what each method compiles to, next to what its plan predicts.

    .venv/bin/python benchmarks/methods.py  # -> benchmarks/results/methods.md
    .venv/bin/python benchmarks/methods.py --out /tmp/m.md

Per method (DataParallel, Zero2Parallel, Zero3Parallel, ShardParallel) x model (MLP, one BERT
layer, BERT MLM, GPT) on 8 simulated CPU devices as a 2 x 4 mesh, with Adam: the collectives in
the compiled HLO (count and bytes per kind), the ones the plan predicts, the bytes all-gathered
per step over the parameter bytes, and the optimizer update's FLOPs per device (the elementwise
work after the last matmul, divided by the shards its output is split into). XLA:CPU compiles a
reduce-scatter as an all-reduce (JAX_NOTES), so a ZeRO gradient reduction shows as an
all-reduce here. `make bench` runs it (from run_all.py). Nothing is invented: a case that fails
says so in its row.
"""
from __future__ import annotations

import json
import os
import sys
import time

from common import collective_kinds, md_row, run_worker, section_head, section_main, section_tail

MODELS = ("mlp", "bert_layer", "bert_mlm", "gpt")
METHODS = ("DataParallel", "Zero2Parallel", "Zero3Parallel", "ShardParallel")


def _case(name: str):
    """(step, state, batch) of a model, Adam, batch 16-32."""
    import jax
    import optax
    from flax.training import train_state

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
    from autopar.models.mlp import MLP, make_mlp_batch, mse_loss

    def ts(net, params):
        return train_state.TrainState.create(apply_fn=net.apply, params=params,
                                             tx=optax.adam(1e-3))
    if name == "bert_mlm":
        model = BertMLM(vocab=512, seq=32, hidden=128, heads=4, layers=2)
        batch = bert_batch(16, 32, 512)
        return bert_step, bert_state(model, batch), batch
    if name == "bert_layer":
        model, batch = LayerOnly(128, 4), layer_batch(16, 32, 128)
        return layer_step, ts(model, model.init(jax.random.key(0), batch["x"],
                                                batch["attention"])), batch
    def step_of(loss_of):
        def step(state, batch):
            loss, grads = jax.value_and_grad(lambda p: loss_of(state.apply_fn, p, batch))(
                state.params)
            return state.apply_gradients(grads=grads), loss
        return step
    if name == "gpt":
        cfg = GPTConfig(vocab_size=512, seq_len=32, num_layers=2, hidden=128, num_heads=4)
        batch, net = make_gpt_batch(jax.random.key(1), 16, cfg), GPT(cfg)
        step = step_of(lambda f, p, b: gpt_loss(f(p, b["tokens"]), b["tokens"]))
        return step, ts(net, net.init(jax.random.key(0), batch["tokens"])), batch
    net = MLP(num_layers=6, hidden=256)
    batch = make_mlp_batch(jax.random.key(1), 32, 256, 256)
    step = step_of(lambda f, p, b: mse_loss(f(p, b["x"]), b["y"]))
    return step, ts(net, net.init(jax.random.key(0), batch["x"])), batch


def _update_flops(graph, plan) -> float:
    """FLOPs per device of the elementwise work no matmul follows (the optimizer update)."""
    from autopar.core.primitives import ARITHMETIC
    from autopar.core.spec import num_shards
    from autopar.intra_op.phases import deferred_nodes
    specs = dict(plan.constraints)
    total = 0.0
    for n in deferred_nodes(graph):
        node = graph.nodes[n]
        if node.primitive in ARITHMETIC and node.outputs:
            spec = specs.get(node.outputs[0])
            total += node.flops / (num_shards(spec, plan.mesh_shape) if spec else 1)
    return total


def _worker(out_path: str) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
    import jax

    import autopar
    from autopar.cost.hlo import collectives, summary
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    rows = []
    for model in MODELS:
        for method in METHODS:
            row = {"model": model, "method": method}
            try:
                step, state, batch = _case(model)
                par = autopar.parallelize(step, mesh=mesh, method=getattr(autopar, method)(),
                                          plan_cache=False)
                t0 = time.perf_counter()
                plan = par.get_plan(state, batch)
                compiled = par.get_compiled(state, batch)
                row["plan_compile_s"] = time.perf_counter() - t0
                row["compiled"] = summary(collectives(compiled.as_text()))
                predicted = {}
                for c in plan.collectives:
                    n, b = predicted.get(c.kind, (0, 0))
                    predicted[c.kind] = (n + 1, b + float(getattr(c, "nbytes", 0) or 0))
                row["predicted"] = predicted
                row["param_bytes"] = sum(x.size * x.dtype.itemsize
                                         for x in jax.tree_util.tree_leaves(state.params))
                row["update_flops"] = _update_flops(par.get_graph(state, batch), plan)
                row["flops"] = float(compiled.cost_analysis().get("flops", 0.0))
            except Exception as e:          # noqa: BLE001 - a failed case is reported in its row
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"methods: {model} {method} done", file=sys.stderr, flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f)


def run(timeout_s: float = 1800) -> dict:
    return run_worker(__file__, [], timeout_s)


def section(res: dict, cmdline: str) -> str:
    out = section_head("Method promises", res, cmdline) + [
           "2 x 4 mesh of simulated CPU devices, Adam. *gathered* = bytes all-gathered per step "
           "/ parameter bytes; *update FLOPs* = the optimizer's elementwise FLOPs per device; "
           "XLA:CPU shows a reduce-scatter as an all-reduce. Predicted counts are before XLA "
           "combines independent all-reduces (and all-gathers) into one instruction; the bytes "
           "agree.", "",
           md_row(["model", "method", "compiled collectives", "predicted by the plan",
                   "gathered", "update FLOPs / device", "step FLOPs / device"]),
           md_row(["---"] * 2 + ["---"] * 2 + ["---:"] * 3)]
    for row in res.get("rows", []):
        if "error" in row:
            out.append(md_row([row["model"], row["method"], f"failed: {row['error']}", "",
                               "", "", ""]))
            continue
        gathered = row["compiled"].get("all-gather", (0, 0))[1] / row["param_bytes"]
        out.append(md_row([row["model"], row["method"], collective_kinds(row["compiled"]),
                           collective_kinds(row["predicted"]), f"{gathered:.2f}x",
                           f"{row['update_flops']:,.0f}", f"{row['flops']:,.0f}"]))
    return section_tail(out, res)


def main(argv=None) -> int:
    return section_main(argv, doc=__doc__, key="methods", script="methods.py", worker=_worker,
                        run=run, section=section)


if __name__ == "__main__":
    sys.exit(main())
