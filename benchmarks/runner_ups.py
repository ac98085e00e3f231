"""Why this plan: what pricing the runner-ups costs, and what they say.

    .venv/bin/python benchmarks/runner_ups.py  # -> benchmarks/results/runner_ups.md
    .venv/bin/python benchmarks/runner_ups.py --out /tmp/r.md --layers 2 6

The GPT of `make bench` (hidden 768, 12 heads, vocab 8192, seq_len 128, batch 8, adamw) on 8
simulated CPU devices as a 2 x 4 mesh, planned by `ShardParallel` (abstract state: nothing is
allocated or compiled), after a warm-up plan of the smallest size. Per size, the step is
planned twice on fresh `autopar.parallelize` objects, runner-ups off
(`AUTOPAR_RUNNER_UPS=off`) then on, side by side in one process: the
search's own time (trace + intra-op ILP), the runner-ups' time (each rival's ILP, capped at
a quarter of the search's time or 2 s) and their share, and each rival's predicted step as a
multiple of the chosen plan's ("-": not priced within the cap). `make bench` runs it (from
run_all.py). Nothing is invented: a case that fails says so.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from common import md_row, result_path, run_worker, section_head, section_tail, write_result

LAYERS = (2, 6, 12, 24)
DEFAULT_OUT = result_path("runner_ups")


def _worker(out_path: str, layers_list) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
    os.environ["AUTOPAR_PLAN_CACHE"] = "off"
    import jax
    import optax
    from flax.training import train_state

    import autopar
    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])

    def step(state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: gpt_loss(state.apply_fn(p, batch["tokens"]), batch["tokens"]))(state.params)
        return state.apply_gradients(grads=grads), loss
    rows = []
    for i, layers in enumerate((min(layers_list), *layers_list)):   # the first: a warm-up
        cfg = GPTConfig(vocab_size=8192, seq_len=128, num_layers=layers, hidden=768,
                        num_heads=12)
        net, batch = GPT(cfg), make_gpt_batch(jax.random.key(1), 8, cfg)
        state = jax.eval_shape(lambda: train_state.TrainState.create(
            apply_fn=net.apply, params=net.init(jax.random.key(0), batch["tokens"]),
            tx=optax.adamw(1e-3)))
        row = {"layers": layers}
        try:
            for mode in ("off", "on"):
                os.environ["AUTOPAR_RUNNER_UPS"] = mode
                t0, c0 = time.perf_counter(), time.process_time()
                plan = autopar.parallelize(step, mesh=mesh, batch_argnums=(1,),
                                           plan_cache=False).get_plan(state, batch)
                row[mode] = {"wall_s": time.perf_counter() - t0,
                             "cpu_s": time.process_time() - c0,
                             "search_s": plan.timings_s.get("trace", 0.0)
                             + plan.timings_s.get("intra_op", 0.0),
                             "runner_ups_s": plan.timings_s.get("runner_ups", 0.0),
                             "step_s": plan.predicted_step_s,
                             "alternatives": list(plan.alternatives)}
        except Exception as e:          # noqa: BLE001 - a failed case is reported in its row
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if i == 0:
            continue
        rows.append(row)
        print(f"runner_ups: {layers} layers done", file=sys.stderr, flush=True)
        with open(out_path, "w") as f:      # after every case: a killed run keeps them
            json.dump(rows, f)


def run(layers=LAYERS, timeout_s: float = 1800) -> dict:
    return run_worker(__file__, ["--layers", *map(str, layers)], timeout_s)


def _rivals(on: dict) -> str:
    parts = []
    for a in on["alternatives"]:
        s = a["predicted_step_s"]
        parts.append(f"{a['name'][:-2]} " + (f"{s / on['step_s']:.2f}x" if s is not None
                                             else "-") + ("" if a["fits"] in (True, None)
                                                          else " (over budget)"))
    return ", ".join(parts)


def section(res: dict, cmdline: str) -> str:
    out = section_head("Why this plan: what the runner-ups cost", res, cmdline) + [
        "GPT of `make bench` (hidden 768, vocab 8192, seq 128, batch 8, adamw), ShardParallel on "
        "a 2 x 4 mesh of simulated CPU devices, planned only (abstract state), runner-ups off "
        "then on in one process. *search*: trace + intra-op ILP of the run with them on; "
        "*runner-ups*: their time and its share of the search's; *plan wall / CPU (on / off)*: "
        "the whole `get_plan` call with them on over off; *rivals*: predicted step over the "
        "chosen plan's (-: not priced within the cap).", "",
        md_row(["layers", "search (s)", "runner-ups (s)", "share", "plan wall on / off",
                "plan CPU on / off", "rivals"]),
        md_row(["---:", "---:", "---:", "---:", "---:", "---:", "---"])]
    for row in res.get("rows", []):
        if "error" in row:
            out.append(md_row([str(row["layers"]), f"failed: {row['error']}"] + [""] * 5))
            continue
        on, off = row["on"], row["off"]
        out.append(md_row([
            str(row["layers"]), f"{on['search_s']:.2f}", f"{on['runner_ups_s']:.2f}",
            f"{on['runner_ups_s'] / max(on['search_s'], 1e-9):.0%}",
            f"{on['wall_s'] / off['wall_s']:.2f}", f"{on['cpu_s'] / off['cpu_s']:.2f}",
            _rivals(on)]))
    return section_tail(out, res)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="the Markdown file to write (default: benchmarks/results/runner_ups.md)")
    ap.add_argument("--layers", type=int, nargs="*", default=list(LAYERS))
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        _worker(args._worker, tuple(args.layers))
        return 0
    cmd = "python benchmarks/runner_ups.py" + "".join(
        f" {flag} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for flag, v, default in (("--out", args.out, DEFAULT_OUT),
                                 ("--layers", args.layers, list(LAYERS))) if v != default)
    text = section(run(tuple(args.layers)), cmd)
    write_result(text, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
