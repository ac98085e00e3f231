"""Multi-host runs and the plan cache: benchmarks/results/multihost.md (run by `run_all.py`,
i.e. `make bench`; alone: `python benchmarks/multihost.py`).

1. Plan cache: `get_plan` of a fresh `autopar.parallelize` with an empty cache directory (a
   search) against a second fresh one reading the entry the first wrote (a hit), for the GPT of
   the ShardParallel benchmark (12 layers, 2 x 4 mesh) and for a 2-stage pipeline of it (a hit
   replays the stages, re-solving only their ILPs). Both include tracing the step. Medians of 3
   alternating rounds in one process.
2. Step time of one process with 8 simulated CPU devices against 2 processes x 4 devices
   (`python -m autopar launch`), same GPT, same plans (ShardParallel on the 2 x 4 mesh, and a
   2-stage 1F1B pipeline whose stages sit on different processes in the 2-process run). A step
   ends with `autopar.to_host(loss)`; median of the timed steps after 2 warm-up steps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import (
    REPO,
    cpu_model,
    fmt,
    gpt_state_fn,
    gpt_train_step,
    load_avg,
    result_path,
    setup_worker,
    source_revision,
    utc_now,
    write_result,
)

CACHE_CFG = dict(vocab_size=8192, seq_len=128, num_layers=12, hidden=768, num_heads=12)
STEP_CFG = dict(vocab_size=2048, seq_len=128, num_layers=8, hidden=256, num_heads=4)
CACHE_BATCH, STEP_BATCH, WARMUP = 8, 32, 2


def _methods(autopar, layers: int) -> dict:
    return {"ShardParallel": autopar.ShardParallel(),
            "2-stage 1F1B pipeline": autopar.PipeshardParallel(
                num_microbatches=8 if layers == STEP_CFG["num_layers"] else 4,
                schedule=autopar.Schedule.ONE_F_ONE_B,
                layer_option=autopar.AutoLayerOption(num_layers=4),
                stage_option=autopar.UniformStageOption(num_stages=2))}


def _gpt(cfg: dict, batch: int):
    import jax
    import optax

    import autopar
    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch
    config = GPTConfig(**cfg)
    model = GPT(config)
    key = jax.random.key(0)
    state = jax.jit(gpt_state_fn(model, optax.adamw(1e-4), config.seq_len))(key)
    return (gpt_train_step(gpt_loss, autopar.value_and_grad), state,
            make_gpt_batch(jax.random.fold_in(key, 1), batch, config))


def _cache_worker(out: str, rounds: int) -> None:
    setup_worker(8)
    import jax

    import autopar
    step, state, batch = _gpt(CACHE_CFG, CACHE_BATCH)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    result = {}
    for name, method in _methods(autopar, CACHE_CFG["num_layers"]).items():
        times = {"search": [], "hit": [], "lookup": []}
        ilps = {}
        for _ in range(rounds):
            with tempfile.TemporaryDirectory() as d:
                for kind in ("search", "hit"):
                    fn = autopar.parallelize(step, mesh=mesh, method=method, plan_cache=d)
                    t0 = time.perf_counter()
                    plan = fn.get_plan(state, batch)
                    times[kind].append(time.perf_counter() - t0)
                    assert plan.origin == ("search" if kind == "search" else "plan cache")
                    if kind == "hit":
                        times["lookup"].append(plan.timings_s["plan_lookup"])
                    ilps[kind] = plan.pipeline.get("num_ilps")
        result[name] = {**{k: statistics.median(v) for k, v in times.items()},
                        **{f"ilps_{k}": v for k, v in ilps.items()}}
    with open(out, "w") as f:
        json.dump(result, f)


def _step_worker(out: str, steps: int) -> None:
    if "AUTOPAR_NUM_PROCESSES" not in os.environ:
        setup_worker(8)
    import jax
    import numpy as np

    import autopar
    info = autopar.init_distributed()
    step, state, batch = _gpt(STEP_CFG, STEP_BATCH)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    result = {"processes": info.num_processes}
    for name, method in _methods(autopar, STEP_CFG["num_layers"]).items():
        fn = autopar.parallelize(step, mesh=mesh, method=method, plan_cache=False)
        s, times = state, []
        for i in range(WARMUP + steps):
            t0 = time.perf_counter()
            s, loss = fn(s, batch)
            loss = float(autopar.to_host(loss))
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        result[name] = {"step_s": statistics.median(times), "loss": loss}
    if info.process_id == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _child(args: list[str], launch: bool, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        script = [os.path.abspath(__file__), *args, out]
        env = {**os.environ, "PYTHONPATH": REPO, "AUTOPAR_PLAN_CACHE": "off"}
        cmd = ([sys.executable, "-m", "autopar.runtime.launch", "--num-processes", "2",
                "--devices-per-process", "4", "--timeout", str(timeout_s), *script] if launch
               else [sys.executable, *script])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=timeout_s + 60)
        if r.returncode != 0 or not os.path.exists(out):
            return {"error": f"exit {r.returncode}: {(r.stdout + r.stderr)[-600:]}"}
        with open(out) as f:
            return {**json.load(f), "wall_s": time.perf_counter() - t0}


def run(steps: int = 10, rounds: int = 3) -> dict:
    res = {"started": utc_now(), "revision": source_revision(), "cpu": cpu_model()}
    print("multihost: plan cache ...", flush=True)
    res["cache"] = _child(["--_cache", str(rounds)], False, 1200)
    print("multihost: 1 process x 8 devices ...", flush=True)
    res["one"] = _child(["--_steps", str(steps)], False, 900)
    print("multihost: 2 processes x 4 devices ...", flush=True)
    res["two"] = _child(["--_steps", str(steps)], True, 900)
    res["finished"], res["load"], res["steps"] = utc_now(), load_avg(), steps
    return res


def section(res: dict, cmdline: str) -> str:
    out = ["## Multi-host and plan cache", "",
           f"Command: `{cmdline}`; {res['started']} to {res['finished']}, revision "
           f"{res['revision']}, {res['cpu']}, load average at the end {res['load']}.", "",
           "### Plan cache: cached lookup vs fresh search", "",
           f"GPT {CACHE_CFG['num_layers']} layers, hidden {CACHE_CFG['hidden']}, seq "
           f"{CACHE_CFG['seq_len']}, vocab {CACHE_CFG['vocab_size']}, batch {CACHE_BATCH}, "
           "2 x 4 mesh; `get_plan` on a fresh `parallelize` (tracing included), median of 3 "
           "rounds.", ""]
    cache = res["cache"]
    if "error" in cache:
        out.append(f"not measured: {cache['error']}")
    else:
        out += ["| method | fresh search s | cache hit s | of which the lookup s | "
                "search / hit | stage ILPs solved: search / hit |",
                "|---|---:|---:|---:|---:|---:|"]
        ilps = lambda t: ("–" if t.get("ilps_search") is None
                          else f"{t['ilps_search']} / {t['ilps_hit']}")
        for name, t in cache.items():
            if isinstance(t, dict):
                out.append(f"| {name} | {fmt(t['search'])} | {fmt(t['hit'])} | "
                           f"{fmt(t['lookup'])} | {t['search'] / t['hit']:.1f}x | "
                           f"{ilps(t)} |")
        out += ["", "The rest of a hit is tracing the step, which every call with new shapes "
                "does. A pipeline hit replays the cached stages with their ILP solutions "
                "(`ParallelPlan.stage_solutions`): no layer clustering, stage DP or ILP; its "
                "lookup is tracing the microbatch step and the stages' training graphs, which "
                "the lowering needs."]
    out += ["", "### Step time: 2 processes x 4 devices vs 1 process x 8 devices", "",
            f"GPT {STEP_CFG['num_layers']} layers, hidden {STEP_CFG['hidden']}, seq "
            f"{STEP_CFG['seq_len']}, vocab {STEP_CFG['vocab_size']}, batch {STEP_BATCH}, "
            f"adamw, on 8 simulated CPU devices either way; median of {res.get('steps', 10)} "
            "steps after 2 warm-up steps, each ended by `autopar.to_host(loss)`.", ""]
    one, two = res["one"], res["two"]
    if "error" in one or "error" in two:
        out.append(f"not measured: 1 process: {one.get('error', 'ok')}; 2 processes: "
                   f"{two.get('error', 'ok')}")
    else:
        out += ["| plan | 1 process ms | 2 processes ms | 2 / 1 | loss 1 process | "
                "loss 2 processes |", "|---|---:|---:|---:|---:|---:|"]
        for name in (k for k in one if isinstance(one[k], dict)):
            a, b = one[name], two[name]
            out.append(f"| {name} | {a['step_s'] * 1e3:.1f} | {b['step_s'] * 1e3:.1f} | "
                       f"{b['step_s'] / a['step_s']:.2f} | {a['loss']:.6f} | "
                       f"{b['loss']:.6f} |")
        out += ["", "Both runs share this machine's cores; the 2-process run adds gloo "
                "collectives and socket transfers between the processes where the 1-process "
                "run uses in-process copies, so the ratio is the cost of the process boundary "
                "here, not of a network between hosts."]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=result_path("multihost"),
                   help="the Markdown file to write (default: benchmarks/results/multihost.md)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--_cache", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("result", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._cache is not None:
        _cache_worker(args.result, args._cache)
        return 0
    if args._steps is not None:
        _step_worker(args.result, args._steps)
        return 0
    res = run(args.steps)
    text = section(res, "python benchmarks/multihost.py" if argv is None and len(sys.argv) == 1
                   else "benchmarks/multihost.py " + " ".join(sys.argv[1:]))
    write_result(text, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
