"""autopar on one GPU: step time of `jax.jit` vs `autopar.parallelize`, predicted vs measured.

Run on a machine with a GPU (it exits with status 2 and a message where JAX sees none):

    python benchmarks/gpu.py                # 125M and 350M GPT -> benchmarks/results/gpu.md
    python benchmarks/gpu.py --sizes 125M --steps 5 --out /tmp/gpu.md
    python benchmarks/gpu.py --json /tmp/gpu.json --no-write   # results only
    python benchmarks/gpu.py --from-json /tmp/gpu.json    # render saved results (no GPU needed)

What it does, in one process: `autopar.profile` on the 1 x 1 mesh of the first GPU, then the
cluster description from that profile; then for each GPT size (flax linen, bf16 compute, fp32
parameters, adamw, seq 1024, vocab 51200) it trains the same steps three ways, each from the
same initial state with the state donated: plain `jax.jit`, `autopar.parallelize` with
`ShardParallel()` and with `ShardParallel(num_microbatches=4)` (gradient accumulation, the step
taking its gradient with `autopar.value_and_grad`). Each step is ended by
`jax.block_until_ready` on the new state and the loss; the step time is the median of the
timed steps after the warm-up steps; the pipelined step time is that of steps ended by one
`block_until_ready` at the end (host dispatch overlaps the GPU's work). autopar's
`plan.predicted_step_s` is set beside the measured step. The results are saved as JSON after
every case (`--json`), and the report is written to benchmarks/results/gpu.md (`--out`: elsewhere;
`--no-write`: not at all).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import common

# name -> (layers, hidden, heads): GPT-3's 125M and 350M, a 760M that also fits one H100, and
# a tiny one to check the script quickly.
SIZES = {"125M": (12, 768, 12), "350M": (24, 1024, 16), "760M": (24, 1536, 16),
         "tiny": (2, 128, 4)}
VOCAB, SEQ_LEN = 51200, 1024
METHODS = ("jax.jit", "autopar", "autopar M=4")
H100_BF16_PEAK = 989e12           # dense bf16 flop/s, NVIDIA H100 SXM datasheet


def _progress(msg: str) -> None:
    common.progress("gpu", msg)


def _nvidia_smi() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], text=True, capture_output=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _gpus(platform: str):
    import jax
    try:
        return jax.devices(platform)
    except RuntimeError:
        return []


# ---------------------------------------------------------------------------------------------
# Measuring.
# ---------------------------------------------------------------------------------------------

def _time_steps(fn, state, batch, warmup: int, steps: int) -> tuple[dict, object]:
    """Run `warmup + steps` steps, each ended by `block_until_ready`; the first is timed apart
    (it compiles). Then 3 rounds of `steps` steps ended by one `block_until_ready` (as a
    training loop runs: the host dispatches the next step while the GPU runs this one).
    Returns (timings and losses, the last state)."""
    import jax
    times, losses = [], []
    for _ in range(1 + warmup + steps):
        t0 = time.perf_counter()
        state, loss = fn(state, batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, loss = fn(state, batch)
        jax.block_until_ready((state, loss))
        rounds.append((time.perf_counter() - t0) / steps)
    timed = times[1 + warmup:]
    return {"first_step_s": times[0], "step_s": statistics.median(timed),
            "step_min_s": min(timed), "step_max_s": max(timed), "steps_s": timed,
            "pipelined_step_s": statistics.median(rounds), "pipelined_rounds_s": rounds,
            "losses": losses[:3]}, state


def _plan_info(plan) -> dict:
    return {"predicted_step_s": plan.predicted_step_s,
            "predicted_compute_s": plan.predicted_compute_s,
            "predicted_comm_s": plan.predicted_comm_s,
            "predicted_overhead_s": plan.predicted_overhead_s,
            "predicted_peak_bytes": plan.peak_memory_bytes}


def _run_case(name: str, method: str, cluster, preset, mesh, args) -> dict:
    """One size under one method; every failure is recorded, not raised."""
    import jax
    import optax

    import autopar
    from autopar.models.gpt import GPT, GPTConfig, gpt_flops_per_token, gpt_loss, make_gpt_batch

    layers, hidden, heads = SIZES[name]
    dtype = jax.numpy.bfloat16 if args.dtype == "bfloat16" else jax.numpy.float32
    config = GPTConfig(vocab_size=VOCAB, seq_len=args.seq_len, num_layers=layers,
                       hidden=hidden, num_heads=heads, dtype=dtype,
                       param_dtype=jax.numpy.float32)
    model = GPT(config)
    tx = optax.adamw(1e-4)
    out = {"size": name, "method": method, "layers": layers, "hidden": hidden, "heads": heads,
           "batch": args.batch, "flops_per_step": gpt_flops_per_token(config) * args.batch *
           args.seq_len}
    grad = autopar.value_and_grad if method == "autopar M=4" else jax.value_and_grad
    step = common.gpt_train_step(gpt_loss, grad)
    device = mesh.devices.flat[0]
    try:
        with jax.default_device(device):
            state = common.gpt_state_fn(model, tx, args.seq_len)(jax.random.key(0))
            batch = make_gpt_batch(jax.random.key(1), args.batch, config)
        if method == "jax.jit":
            fn = jax.jit(step, donate_argnums=(0,))
        else:
            m = autopar.ShardParallel(num_microbatches=4 if method == "autopar M=4" else 1)
            fn = autopar.parallelize(step, mesh=mesh, method=m, batch_argnums=(1,),
                                     donate_argnums=(0,), cluster=cluster)
            t0 = time.perf_counter()
            plan = fn.get_plan(state, batch)
            out["plan_s"] = time.perf_counter() - t0
            out.update(_plan_info(plan))
            if preset is not None:
                out["predicted_preset_step_s"] = \
                    fn.with_cluster(preset).get_plan(state, batch).predicted_step_s
        timing, state = _time_steps(fn, state, batch, args.warmup, args.steps)
        out.update(timing)
    except Exception as e:       # recorded in the report: a failure is a result here
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        _progress(f"{name} {method}: FAILED {out['error'][:300]}")
    finally:
        state = batch = fn = None
        gc.collect()
    return out


def _cluster(mesh, args, result: dict):
    """(the cluster from the profile, the one read off the devices: datasheet numbers)."""
    import autopar
    t0 = time.perf_counter()
    prof = autopar.profile(mesh, use_cache=False, matmul_size=args.matmul_size,
                           repeats=args.profile_repeats)
    result["profile"] = {"seconds": time.perf_counter() - t0,
                         "matmul_size": args.matmul_size,
                         "matmul_flops_per_s": dict(prof.matmul_flops_per_s),
                         "call_overhead_s": prof.call_overhead_s,
                         "memory_bytes_per_s": prof.memory_bytes_per_s}
    preset = autopar.ClusterSpec.from_devices(mesh.devices.flat)
    try:
        cluster = autopar.ClusterSpec.from_profile(prof)
    except autopar.InvalidArgumentError as e:
        # A 1-device mesh has no link to measure; take the measured matmul flop/s, memory
        # bandwidth and call overhead onto the description read off the device instead.
        result["from_profile_error"] = str(e)
        flops = prof.matmul_flops_per_s
        cluster = preset.with_(name=f"profile:{prof.device_kind}",
                               peak_flops_fp32_per_s=flops["float32"],
                               peak_flops_bf16_per_s=flops.get("bfloat16", flops["float32"]),
                               call_overhead_s=prof.call_overhead_s,
                               hbm_bandwidth_bytes_per_s=(prof.memory_bytes_per_s or
                                                          preset.hbm_bandwidth_bytes_per_s))
    result["cluster"] = {"name": cluster.name, "memory_bytes": cluster.memory_bytes,
                         "peak_flops_bf16_per_s": cluster.peak_flops_bf16_per_s,
                         "peak_flops_fp32_per_s": cluster.peak_flops_fp32_per_s,
                         "hbm_bandwidth_bytes_per_s": cluster.hbm_bandwidth_bytes_per_s,
                         "call_overhead_s": cluster.call_overhead_s,
                         "preset": preset.name,
                         "preset_peak_flops_bf16_per_s": preset.peak_flops_bf16_per_s}
    return cluster, preset


def measure(args) -> dict:
    import jax
    import jaxlib
    import numpy as np

    sys.path.insert(0, common.REPO)
    devices = _gpus(args.platform)
    if not devices:
        print(f"benchmarks/gpu.py: JAX sees no {args.platform} device (jax.devices("
              f"{args.platform!r}) is empty or fails), so there is nothing to measure. Run it "
              "on a machine with a GPU and a CUDA jaxlib (e.g. JAX_PLATFORMS=cuda).",
              file=sys.stderr)
        raise SystemExit(2)
    t_start = time.perf_counter()
    dev = devices[0]
    mesh = jax.sharding.Mesh(np.array([dev]).reshape(1, 1), ("data", "model"))
    result = {"command": "python " + shlex.join([os.path.relpath(__file__, common.REPO)] +
                                                sys.argv[1:]),
              "date_utc": common.utc_now(), "revision": args.revision or
              common.source_revision(), "nvidia_smi": _nvidia_smi(),
              "device_kind": dev.device_kind, "platform": dev.platform,
              "jax": jax.__version__, "jaxlib": jaxlib.__version__,
              "python": sys.version.split()[0],
              "seq_len": args.seq_len, "batch": args.batch, "dtype": args.dtype,
              "warmup": args.warmup, "steps": args.steps, "cases": []}
    _progress(f"{dev.device_kind}, jax {jax.__version__}: profiling")
    cluster, preset = _cluster(mesh, args, result)
    _save(result, args.json)
    for name in args.sizes:
        for method in METHODS:
            if time.perf_counter() - t_start > args.budget_s:
                result["cases"].append({"size": name, "method": method, "error":
                                        f"not run: the {args.budget_s:.0f} s budget was spent"})
                continue
            _progress(f"{name} {method}")
            case = _run_case(name, method, cluster, preset, mesh, args)
            result["cases"].append(case)
            _save(result, args.json)
            if "step_s" in case:
                _progress(f"{name} {method}: step {case['step_s'] * 1e3:.1f} ms (pipelined "
                          f"{case['pipelined_step_s'] * 1e3:.1f}), predicted "
                          f"{case.get('predicted_step_s', float('nan')) * 1e3:.1f} ms, first "
                          f"{case['first_step_s']:.1f} s")
    result["total_s"] = time.perf_counter() - t_start
    _save(result, args.json)
    return result


def _save(result: dict, path: str | None) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------

def _ratio(a, b) -> str:
    return "–" if a is None or b is None or not b else f"{a / b:.2f}"


def _case_row(c: dict, jit: dict | None) -> str:
    cfg = f"{c['size']} ({c.get('layers', '?')} x {c.get('hidden', '?')})"
    if "step_s" not in c:
        return common.md_row([cfg, c["method"], "failed: " + c.get("error", "no result")
                              .replace("|", "\\|").replace("\n", " ")[:300]] + ["–"] * 11)
    jit = jit or {}
    pipelined = c["pipelined_step_s"]
    return common.md_row([
        cfg, c["method"], common.ms(c["step_s"]),
        f"{common.ms(c['step_min_s'])}–{common.ms(c['step_max_s'])}", common.ms(pipelined),
        f"{c['flops_per_step'] / pipelined / 1e12:.0f}",
        _ratio(c["step_s"], jit.get("step_s")), _ratio(pipelined, jit.get("pipelined_step_s")),
        common.ms(c.get("predicted_step_s")), _ratio(c.get("predicted_step_s"), c["step_s"]),
        common.ms(c.get("predicted_preset_step_s")),
        common.fmt(c.get("plan_s"), 1), f"{c['first_step_s']:.1f}",
        " / ".join(f"{x:.4f}" for x in c["losses"])])


def render(r: dict) -> str:
    prof, cl = r.get("profile", {}), r.get("cluster", {})
    flops = prof.get("matmul_flops_per_s", {})
    lines = [
        "## GPU", "",
        f"Run on {r['date_utc']} UTC at revision {r['revision']}, with", "",
        f"    {r['command']}", "",
        f"- Machine: `{r.get('nvidia_smi') or 'nvidia-smi not available'}` (nvidia-smi: name, "
        f"memory, driver); JAX device kind `{r['device_kind']}` (platform `{r['platform']}`).",
        f"- Software: jax {r['jax']}, jaxlib {r['jaxlib']}, Python {r['python']}.",
        f"- Workload: flax linen GPT (`autopar/models/gpt.py`), vocab {VOCAB}, seq {r['seq_len']}, "
        f"batch {r['batch']}, {r['dtype']} compute with fp32 parameters, `optax.adamw`; one GPU "
        "as a 1 x 1 mesh. Each method starts from the same initial state and batch, with the "
        "state donated; each step is ended by `jax.block_until_ready` on the new state and the "
        f"loss. *step*: median of {r['steps']} such steps after the first (compiling) step "
        f"and {r['warmup']} warm-up steps; *range*: the fastest and slowest of them. "
        f"*pipelined*: {r['steps']} steps ended by one `block_until_ready`, per step (median "
        "of 3 rounds), as a training loop runs them: the host dispatches the next step while "
        "the GPU runs this one. *TFLOP/s*: the model's flops per step (`gpt_flops_per_token`, "
        "6N + attention) over the pipelined step.",
        f"- Profile (`autopar.profile`, {prof.get('seconds', 0):.1f} s): matmul "
        f"{prof.get('matmul_size')}^3 at " + ", ".join(
            f"{d} {v / 1e12:.0f} TFLOP/s" for d, v in flops.items()) +
        f"; fused elementwise kernel {(prof.get('memory_bytes_per_s') or 0) / 1e12:.2f} TB/s"
        f"; call overhead {common.ms(prof.get('call_overhead_s'), 3)} ms.",
    ]
    if "from_profile_error" in r:
        lines.append(
            "- `ClusterSpec.from_profile` refused the 1 x 1 profile (\"" +
            r["from_profile_error"].split(". Fix")[0] + "\"), so the cluster is "
            f"`ClusterSpec.from_devices` (`{cl.get('preset')}`) with the profile's matmul "
            "flop/s as peaks, its memory bandwidth and its call overhead.")
    lines += [
        f"- Cluster the plans were costed with: `{cl.get('name')}`, bf16 peak "
        f"{cl.get('peak_flops_bf16_per_s', 0) / 1e12:.0f} TFLOP/s, fp32 "
        f"{cl.get('peak_flops_fp32_per_s', 0) / 1e12:.0f}, HBM "
        f"{cl.get('hbm_bandwidth_bytes_per_s', 0) / 1e12:.2f} TB/s, memory "
        f"{cl.get('memory_bytes', 0) / 2**30:.1f} GiB (the GPU's `bytes_limit`). *pred. "
        f"preset* is the plan's prediction under `{cl.get('preset')}` as read off the device "
        "(datasheet peaks) instead.",
        "- *autopar M=4*: `ShardParallel(num_microbatches=4)`, gradient accumulation over 4 "
        "microbatches (the step takes `autopar.value_and_grad`); *autopar*: `ShardParallel()`. "
        "*/ jit*: the step time over `jax.jit`'s (step, pipelined); *pred. / meas.*: "
        "`plan.predicted_step_s` over the measured step.", "",
        common.md_row(["GPT", "method", "step ms", "range ms", "pipelined ms", "TFLOP/s",
                       "/ jit", "/ jit pipelined", "predicted ms", "pred. / meas.",
                       "pred. preset ms", "plan s", "first step s", "loss steps 0-2"]),
        common.md_row(["---"] * 14),
    ]
    jits = {c["size"]: c for c in r["cases"] if c["method"] == "jax.jit"}
    lines += [_case_row(c, jits.get(c["size"])) for c in r["cases"]]
    lines += ["", "Ratios:", ""]
    for c in r["cases"]:
        jit = jits.get(c["size"], {})
        if c["method"] != "jax.jit" and "step_s" in c and "step_s" in jit:
            lines.append(f"- {c['size']} {c['method']}: autopar / jit = "
                         f"{_ratio(c['step_s'], jit['step_s'])} (pipelined: "
                         f"{_ratio(c['pipelined_step_s'], jit['pipelined_step_s'])}), "
                         "predicted / measured = "
                         f"{_ratio(c.get('predicted_step_s'), c['step_s'])} (datasheet "
                         f"preset: {_ratio(c.get('predicted_preset_step_s'), c['step_s'])})")
    if "total_s" in r:
        lines += ["", f"Total run time {r['total_s']:.0f} s."]
    if r.get("notes"):             # added to the saved JSON by hand (rendered by --from-json)
        lines += ["", "Notes:", ""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["125M", "350M"], choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="compute dtype (parameters stay fp32)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    ap.add_argument("--matmul-size", type=int, default=4096, help="n of the profile's matmul")
    ap.add_argument("--profile-repeats", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no new case after this many seconds")
    ap.add_argument("--platform", default="gpu", help=argparse.SUPPRESS)   # "cpu": dry runs
    ap.add_argument("--revision", default=None, help="source revision to report")
    ap.add_argument("--json", default=None, help="also save the results here")
    ap.add_argument("--from-json", default=None, help="render saved results; measure nothing")
    ap.add_argument("--out", default=common.result_path("gpu"),
                    help="the Markdown file to write (default: benchmarks/results/gpu.md)")
    ap.add_argument("--no-write", action="store_true", help="do not write the Markdown")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
    else:
        result = measure(args)
    text = render(result)
    print(text)
    if not args.no_write:
        common.write_result(text, args.out)
        _progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
