"""Loops: a scanned GPT (`nn.scan` over blocks, stacked parameters) next to its unrolled twin.

    .venv/bin/python benchmarks/loops.py                  # -> benchmarks/results/loops.md
    .venv/bin/python benchmarks/loops.py --out /tmp/l.md --layers 4 --plan-layers 48

A linen GPT (hidden 256, 8 heads, vocab 1024, seq_len 64, batch 16, adamw) on 8 simulated CPU
devices as a 2 x 4 mesh, planned by `ShardParallel`, with `scan_layers=True` and without. Per
case: the planning time (trace + intra-op ILP) and ILP size; for the compiled sizes the temp
bytes per device (`memory_analysis().temp_size_in_bytes`) next to the same step jitted on one
device, and the collectives of the compiled HLO, all and inside `while` bodies (a planned
loop body has its Megatron/DP collectives there). The largest size is planned only.
`make bench` runs it (from run_all.py). Nothing is invented: a case that fails says so.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from common import (
    collective_kinds,
    md_row,
    result_path,
    run_worker,
    section_head,
    section_tail,
    write_result,
)

COMPILED_LAYERS, PLAN_LAYERS = (4, 12), (48,)
DEFAULT_OUT = result_path("loops")


def _case(layers: int, scan: bool):
    import jax
    import optax
    from flax.training import train_state

    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch
    cfg = GPTConfig(vocab_size=1024, seq_len=64, num_layers=layers, hidden=256, num_heads=8,
                    scan_layers=scan)
    net, batch = GPT(cfg), make_gpt_batch(jax.random.key(1), 16, cfg)
    state = jax.eval_shape(lambda: train_state.TrainState.create(
        apply_fn=net.apply, params=net.init(jax.random.key(0), batch["tokens"]),
        tx=optax.adamw(1e-3)))

    def step(state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: gpt_loss(state.apply_fn(p, batch["tokens"]), batch["tokens"]))(state.params)
        return state.apply_gradients(grads=grads), loss
    return step, state, batch


def _worker(out_path: str, compiled_layers, plan_layers) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
    import jax

    import autopar
    from autopar.cost.hlo import collectives, loop_body_collectives, summary
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    rows = []
    for layers in (*compiled_layers, *plan_layers):
        for scan in (True, False):
            row = {"layers": layers, "scan": scan}
            try:
                step, state, batch = _case(layers, scan)
                par = autopar.parallelize(step, mesh=mesh, batch_argnums=(1,),
                                          plan_cache=False)
                t0 = time.perf_counter()
                plan = par.get_plan(state, batch)
                row["plan_s"] = time.perf_counter() - t0
                row["ilp_groups"], row["ilp_vars"] = (plan.ilp["num_groups"],
                                                      plan.ilp["num_variables"])
                if layers in compiled_layers:
                    text_of = lambda c: c.as_text()                      # noqa: E731
                    compiled = par.get_compiled(state, batch)
                    row["temp"] = compiled.memory_analysis().temp_size_in_bytes
                    row["compiled"] = summary(collectives(text_of(compiled)))
                    row["in_loops"] = summary(loop_body_collectives(text_of(compiled)))
                    one = jax.jit(step).lower(state, batch).compile()
                    row["temp_one_device"] = one.memory_analysis().temp_size_in_bytes
            except Exception as e:          # noqa: BLE001 - a failed case is reported in its row
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"loops: {layers} layers {'scan' if scan else 'unrolled'} done",
                  file=sys.stderr, flush=True)
            with open(out_path, "w") as f:      # after every case: a killed run keeps them
                json.dump(rows, f)


def run(compiled_layers=COMPILED_LAYERS, plan_layers=PLAN_LAYERS,
        timeout_s: float = 1800) -> dict:
    return run_worker(__file__, ["--layers", *map(str, compiled_layers),
                                 "--plan-layers", *map(str, plan_layers)], timeout_s)


def section(res: dict, cmdline: str) -> str:
    out = section_head("Loops (scanned vs unrolled GPT)", res, cmdline) + [
           "Linen GPT (hidden 256, 8 heads, vocab 1024, seq 64, batch 16, adamw), ShardParallel "
           "on a 2 x 4 mesh of simulated CPU devices. *scan*: `nn.scan` over the blocks "
           "(`GPTConfig.scan_layers`), the body planned once and costed x layers. *temp*: "
           "compiled temp bytes per device; */ 1 device*: over the same step jitted on one "
           "device. *in loops*: collectives inside `while` bodies (run every iteration).", "",
           md_row(["layers", "model", "plan (s)", "ILP groups", "ILP variables", "temp / device",
                   "/ 1 device", "collectives", "in loops"]),
           md_row(["---:", "---", "---:", "---:", "---:", "---:", "---:", "---", "---"])]
    for row in res.get("rows", []):
        name = "scan" if row["scan"] else "unrolled"
        if "error" in row:
            out.append(md_row([str(row["layers"]), name, f"failed: {row['error']}"] + [""] * 6))
            continue
        temp = row.get("temp")
        out.append(md_row([
            str(row["layers"]), name, f"{row['plan_s']:.1f}", str(row["ilp_groups"]),
            str(row["ilp_vars"]),
            f"{temp / 2**20:.2f} MiB" if temp is not None else "not compiled (plan only)",
            f"{temp / row['temp_one_device']:.2f}" if temp is not None else "",
            collective_kinds(row["compiled"], kib=False) if temp is not None else "",
            collective_kinds(row["in_loops"], kib=False) if temp is not None else ""]))
    return section_tail(out, res)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="the Markdown file to write (default: benchmarks/results/loops.md)")
    ap.add_argument("--layers", type=int, nargs="*", default=list(COMPILED_LAYERS),
                    help="sizes planned and compiled")
    ap.add_argument("--plan-layers", type=int, nargs="*", default=list(PLAN_LAYERS),
                    help="sizes planned only")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        _worker(args._worker, tuple(args.layers), tuple(args.plan_layers))
        return 0
    cmd = "python benchmarks/loops.py" + "".join(
        f" {flag} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for flag, v, default in (("--out", args.out, DEFAULT_OUT),
                                 ("--layers", args.layers, list(COMPILED_LAYERS)),
                                 ("--plan-layers", args.plan_layers, list(PLAN_LAYERS)))
        if v != default)
    text = section(run(tuple(args.layers), tuple(args.plan_layers)), cmd)
    write_result(text, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
