"""Pipeline schedules side by side: predicted and measured step of 1F1B, ZB-H1 and ZB-H2 on
the same stages, and what `Schedule.AUTO` chooses.

    .venv/bin/python benchmarks/schedules.py  # -> benchmarks/results/schedules.md
    .venv/bin/python benchmarks/schedules.py --out /tmp/s.md --rounds 3

A GPT (4 layers, hidden 128, 4 heads, vocab 1024, seq 64, batch 32, adam) as a 4-stage
pipeline with 8 microbatches on 8 simulated CPU devices (2 x 4 mesh, 2 devices per stage),
uniform stages. Each schedule is planned and compiled once; then `--rounds` rounds each run
every schedule `--steps` steps in turn (after a warm-up step), so the machine's load falls
alike on all of them: the median step per schedule, and its ratio to 1F1B's in the same
round. Predicted: the plan's step (1F1B's formula scaled by the table's simulated makespan)
with the `cpu` preset and, for the same stages' graphs, the V100 preset's prediction, each
over 1F1B's. Losses are compared with 1F1B's (the same stages, so equal to rounding).
`make bench` runs it (from run_all.py). Nothing is invented: a case that fails says so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from common import md_row, result_path, run_worker, section_head, section_tail, write_result

SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "auto")
DEFAULT_OUT = result_path("schedules")


def _worker(out_path: str, rounds: int, steps: int) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
    os.environ["AUTOPAR_PLAN_CACHE"] = "off"
    import jax
    import numpy as np
    import optax

    import autopar
    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch
    from autopar.verify.pipeline_memory_check import compiled_per_device, stage_memory
    cfg = GPTConfig(vocab_size=1024, seq_len=64, num_layers=4, hidden=128, num_heads=4)
    net, batch = GPT(cfg), make_gpt_batch(jax.random.key(1), 32, cfg)
    params = net.init(jax.random.key(0), batch["tokens"])
    tx = optax.adam(1e-3)
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])

    def step(params, opt, batch):
        loss, grads = autopar.value_and_grad(
            lambda p: gpt_loss(net.apply(p, batch["tokens"]), batch["tokens"]))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    def method(name):
        return autopar.PipeshardParallel(
            num_microbatches=8, schedule=autopar.Schedule(name),
            layer_option=autopar.AutoLayerOption(num_layers=4),
            stage_option=autopar.UniformStageOption(num_stages=4))
    rows, pars, states = {}, {}, {}
    # this machine's cluster as `autopar.profile` measures it (its call overhead included)
    profiled = autopar.ClusterSpec.from_profile(autopar.profile(mesh, use_cache=False))
    for name in SCHEDULES:
        row = rows[name] = {"schedule": name}
        try:
            par = autopar.parallelize(step, mesh=mesh, method=method(name), batch_argnums=(2,))
            t0 = time.perf_counter()
            plan = par.get_plan(params, tx.init(params), batch)
            row["plan_s"] = time.perf_counter() - t0
            v100 = par.with_cluster(autopar.ClusterSpec.preset(
                "v100-p3.16xlarge", num_hosts=1)).get_plan(params, tx.init(params), batch)
            measured_model = par.with_cluster(profiled).get_plan(params, tx.init(params), batch)
            row.update(chosen=plan.pipeline["schedule"],
                       predicted_s=plan.pipeline["predicted_latency_s"],
                       predicted_profiled_s=measured_model.pipeline["predicted_latency_s"],
                       chosen_profiled=measured_model.pipeline["schedule"],
                       call_overhead_s=profiled.call_overhead_s,
                       predicted_v100_s=v100.pipeline["predicted_latency_s"],
                       chosen_v100=v100.pipeline["schedule"], times=[], losses=[])
            t0 = time.perf_counter()
            states[name] = par(params, tx.init(params), batch)      # compile + first step
            jax.block_until_ready(states[name])
            row["first_step_s"] = time.perf_counter() - t0
            leaves = jax.tree_util.tree_leaves((params, tx.init(params), batch))
            memory = stage_memory(par.get_compiled(params, tx.init(params), batch), leaves, 8)
            row["stage_peaks"] = [m.peak for m in memory] if memory else None
            row["device_peaks"] = compiled_per_device(plan, memory) if memory else None
            pars[name] = par
        except Exception as e:          # noqa: BLE001 - a failed case is reported in its row
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    evals = _eval_pipeline(autopar, jax, net, gpt_loss, mesh, params, batch, stage_memory)
    rows["eval"] = evals.pop("row") if "row" in evals else {"schedule": "eval",
                                                           "error": evals.pop("error")}
    for r in range(rounds):
        for name, fn in evals.items():          # the eval pipeline and jax.jit, in turn
            for _ in range(steps):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                rows["eval"][f"{name}_times"].append(time.perf_counter() - t0)
        for name, par in pars.items():
            p, o, _ = states[name]
            for _ in range(steps):
                t0 = time.perf_counter()
                p, o, loss = par(p, o, batch)
                jax.block_until_ready(loss)
                rows[name]["times"].append(time.perf_counter() - t0)
                rows[name]["losses"].append(float(np.asarray(loss)))
            states[name] = (p, o, loss)
        print(f"schedules: round {r + 1} of {rounds}", file=sys.stderr, flush=True)
        with open(out_path, "w") as f:      # after every round: a killed run keeps them
            json.dump(list(rows.values()), f)


def _eval_pipeline(autopar, jax, net, gpt_loss, mesh, params, batch, stage_memory) -> dict:
    """The GPT's eval step (logits and mean loss, no gradient) as a forward-only pipeline on
    the same 4 uniform stages and 8 microbatches, and under `jax.jit` on one device: their
    row (plan time, outputs' difference, compiled peaks per stage) and a call of each."""
    import numpy as np

    def eval_step(params, batch):
        logits = net.apply(params, batch["tokens"])
        return logits, gpt_loss(logits, batch["tokens"])
    try:
        par = autopar.parallelize(eval_step, mesh=mesh, batch_argnums=(1,),
                                  method=autopar.PipeshardParallel(
                                      num_microbatches=8,
                                      layer_option=autopar.AutoLayerOption(num_layers=4),
                                      stage_option=autopar.UniformStageOption(num_stages=4)))
        t0 = time.perf_counter()
        plan = par.get_plan(params, batch)
        row = {"schedule": "eval", "chosen": plan.pipeline["schedule"],
               "plan_s": time.perf_counter() - t0, "pipeline_times": [], "jit_times": []}
        one = jax.devices()[0]
        p1, b1 = jax.device_put((params, batch), one)
        jitted = jax.jit(eval_step)
        got, want = par(params, batch), jitted(p1, b1)
        row["diff"] = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
                          / max(float(np.max(np.abs(np.asarray(w)))), 1e-30)
                          for g, w in zip(got, want))
        memory = stage_memory(par.get_compiled(params, batch),
                              jax.tree_util.tree_leaves((params, batch)), 8)
        row["stage_peaks"] = [m.peak for m in memory] if memory else None
        return {"row": row, "pipeline": lambda: par(params, batch),
                "jit": lambda: jitted(p1, b1)}
    except Exception as e:          # noqa: BLE001 - a failed case is reported in its row
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def run(rounds: int = 5, steps: int = 3, timeout_s: float = 1800) -> dict:
    return run_worker(__file__, ["--rounds", str(rounds), "--steps", str(steps)], timeout_s)


def section(res: dict, cmdline: str) -> str:
    out = section_head("Pipeline schedules: 1F1B, ZB-H1, ZB-H2 and AUTO", res, cmdline) + [
        "GPT (4 layers, hidden 128, seq 64, batch 32, adam), 4 uniform stages of 2 simulated "
        "CPU devices, 8 microbatches. *plan s*: the wall time of `get_plan` on a fresh "
        "`parallelize` (the stages solved, the schedules priced), over 1F1B's; *predicted*: "
        "the plan's step over 1F1B's with the cpu preset, and for the same stages with the "
        "v100 preset, and with this machine's cluster as `autopar.profile` measured it "
        "(`ClusterSpec.from_profile`: its measured call overhead is in the section's "
        "last line); *measured*: the median step over 1F1B's, steps of all schedules "
        "interleaved round by round; *loss vs 1F1B*: the largest relative difference of the "
        "losses, step by step; *compiled peak per stage*: each stage's peak per device "
        "composed from XLA's memory analysis of its executables "
        "(`verify.pipeline_memory_check.stage_memory`), over 1F1B's same stage. "
        "Interleaved and ZB-V put 2 stage chunks on each of 2 groups of 4 devices (stages "
        "k and k+2, or k and 3-k), the others one stage on each of 4 groups of 2: their "
        "stages are other programs on other devices. *peak device*: the most any device "
        "needs (a group's chunks together, `compiled_per_device`), over 1F1B's.", "",
        md_row(["schedule", "runs", "plan s (/ 1F1B)", "predicted / 1F1B (cpu)",
                "predicted / 1F1B (profiled)", "predicted / 1F1B (v100)", "AUTO picks (v100)",
                "measured median step", "measured / 1F1B", "loss vs 1F1B",
                "compiled peak per stage (/ 1F1B)", "peak device (/ 1F1B)"]),
        md_row(["---", "---", "---:", "---:", "---:", "---:", "---", "---:", "---:", "---:",
                "---", "---:"])]
    rows = {r["schedule"]: r for r in res.get("rows", [])}
    base = rows.get("1f1b", {})
    evals = rows.pop("eval", None)
    for name, row in rows.items():
        if "error" in row:
            out.append(md_row([name, f"failed: {row['error']}"] + [""] * 10))
            continue
        med = statistics.median(row["times"]) if row["times"] else float("nan")
        bmed = statistics.median(base["times"]) if base.get("times") else float("nan")
        diff = max((abs(a - b) / abs(b) for a, b in zip(row["losses"], base.get("losses", []))),
                   default=float("nan"))
        out.append(md_row([
            name, row["chosen"],
            f"{row['plan_s']:.1f} ({row['plan_s'] / base['plan_s']:.2f})",
            f"{row['predicted_s'] / base['predicted_s']:.3f}", _profiled(row, base),
            f"{row['predicted_v100_s'] / base['predicted_v100_s']:.3f}", row["chosen_v100"],
            f"{med * 1e3:.1f} ms", f"{med / bmed:.3f}", f"{diff:.1e}", _peaks(row, base),
            _device(row, base)]))
    out += _eval_lines(evals, base)
    if "call_overhead_s" in base:
        out += ["", f"The profiled cluster's call overhead: {base['call_overhead_s'] * 1e6:.0f} "
                "us per executable call (the cpu preset's: 0)."]
    return section_tail(out, res)


def _profiled(row: dict, base: dict) -> str:
    """The prediction with the cluster `autopar.profile` measured, over 1F1B's, and what AUTO
    picks with it."""
    if "predicted_profiled_s" not in row or "predicted_profiled_s" not in base:
        return "not measured"
    text = f"{row['predicted_profiled_s'] / base['predicted_profiled_s']:.3f}"
    return text + (f" (picks {row['chosen_profiled']})" if row["schedule"] == "auto" else "")


def _eval_lines(row: dict | None, base: dict) -> list[str]:
    if row is None:
        return []
    out = ["", "Forward-only: the same GPT's eval step (logits and mean loss, no gradient) as a "
           "pipeline of the same 4 stages and 8 microbatches (`Schedule.FORWARD`), against "
           "`jax.jit` of the step on one device, calls interleaved round by round. *largest "
           "difference*: of the outputs, relative to each output's largest magnitude; "
           "*compiled peak per stage*: over the 1F1B training pipeline's same stage.", "",
           md_row(["step", "plan s", "pipeline median", "jax.jit (1 device) median",
                   "pipeline / jit", "largest difference", "compiled peak per stage "
                   "(/ 1F1B training)"]),
           md_row(["---", "---:", "---:", "---:", "---:", "---:", "---"])]
    if "error" in row:
        return out + [md_row(["eval", f"failed: {row['error']}"] + [""] * 5)]
    pipe = statistics.median(row["pipeline_times"]) if row["pipeline_times"] else float("nan")
    jit = statistics.median(row["jit_times"]) if row["jit_times"] else float("nan")
    return out + [md_row(["eval", f"{row['plan_s']:.1f}", f"{pipe * 1e3:.1f} ms",
                          f"{jit * 1e3:.1f} ms", f"{pipe / jit:.2f}", f"{row['diff']:.1e}",
                          _peaks(row, base)])]


def _device(row: dict, base: dict) -> str:
    got, ref = row.get("device_peaks"), base.get("device_peaks")
    if not got or not ref:
        return "not measured"
    return f"{max(got) / 2**20:.2f} MiB ({max(got) / max(ref):.2f})"


def _peaks(row: dict, base: dict) -> str:
    peaks, ref = row.get("stage_peaks"), base.get("stage_peaks") or []
    if not peaks:
        return "not measured"
    return ", ".join(f"{p / 2**20:.2f} MiB" + (f" ({p / ref[i]:.2f})" if i < len(ref) else "")
                     for i, p in enumerate(peaks))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="the Markdown file to write (default: benchmarks/results/schedules.md)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        _worker(args._worker, args.rounds, args.steps)
        return 0
    cmd = "python benchmarks/schedules.py" + "".join(
        f" {flag} {v}" for flag, v, default in (("--out", args.out, DEFAULT_OUT),
                                                ("--rounds", args.rounds, 5),
                                                ("--steps", args.steps, 3)) if v != default)
    text = section(run(args.rounds, args.steps), cmd)
    write_result(text, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
