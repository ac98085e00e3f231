"""autopar pipeline benchmark (PipeshardParallel): planning cost and executor overhead.

Run from the repository root; it rewrites only the pipeline section of BENCHMARKS.md:

    .venv/bin/python benchmarks/pipeline.py                    # ~10 min on 2 cores
    .venv/bin/python benchmarks/run_all.py --only pipeline     # the same
    .venv/bin/python benchmarks/pipeline.py --plan-layers 12 --plan-hosts 1 --stages 2 \\
        --out /tmp/p.md                                         # a subset, elsewhere

Part 1, planning: `autopar.plan(step, abstract_state, batch, cluster=ClusterSpec.preset(
"v100-p3.16xlarge", num_hosts=H), method=PipeshardParallel(num_microbatches=8,
layer_option=AutoLayerOption(num_layers=8), stage_option=AutoStageOption(logical_shapes=...)))`
for a GPT (hidden 1024, 16 heads, seq 1024, vocab 51200, adam) of 12, 24 and 48 layers on 1 host
(8 devices) and 8 hosts (64 devices). Nothing is allocated: the state is `jax.eval_shape`'d.
The global batch is 32; a case whose plan raises InfeasiblePlanError at 32 is planned again at
16 (both attempts are reported).

Part 2, measured pipeline step on 8 simulated CPU devices: a GPT (hidden 256, 4 heads, seq 128,
vocab 2048, 8 blocks, one layer per block via `mark_stage_boundary` + ManualLayerOption, batch
32, adam) under PipeshardParallel(UniformStageOption(2 and 4), 1F1B, 8 microbatches). The step
is timed as is (median of several steps); then the same program is run once more through an
executor whose stage forward/backward and apply-gradient executables are wrapped to run one
at a time (inputs ready before the clock starts, outputs ready before it stops), which gives
every task's time alone. From those the ideal step time is computed (see `_ideal`), and the
executor overhead is measured / ideal - 1. The same step under ShardParallel is timed for
reference.

Each case runs in its own child process (memory returned, a stuck case killed after
`--case-timeout-s`); progress goes to stderr. Nothing is invented: what was not measured says
so and why.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "BENCHMARKS.md")
BEGIN, END = "<!-- pipeline:begin -->", "<!-- pipeline:end -->"

# Part 1: planning.
PLAN_CFG = dict(hidden=1024, num_heads=16, seq_len=1024, vocab_size=51200)
PLAN_LAYERS = (12, 24, 48)
PLAN_HOSTS = (1, 8)
PLAN_BATCH, PLAN_FALLBACK_BATCH = 32, 16
PLAN_MICROBATCHES = 8
PRESET = "v100-p3.16xlarge"

# Part 2: measured step.
RUN_CFG = dict(hidden=256, num_heads=4, seq_len=128, vocab_size=2048, num_layers=8)
RUN_BATCH, RUN_MICROBATCHES = 32, 8
MESH_SHAPE, AXIS_NAMES = (2, 4), ("data", "model")
NUM_DEVICES = MESH_SHAPE[0] * MESH_SHAPE[1]
RUN_STAGES = (2, 4)
EMPTY_S = 1e-6        # a stage predicted below this (1 us) holds no heavy operator


def _progress(msg: str) -> None:
    stamp = _dt.datetime.now().strftime("%H:%M:%S")
    print(f"[pipeline {stamp}] {msg}", file=sys.stderr, flush=True)


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _source_revision() -> str:
    """The checked-out commit (read-only git calls), marked if autopar/models/benchmarks differ
    from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "autopar", "models",
                                "benchmarks"], cwd=REPO, text=True, capture_output=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" +uncommitted changes" if dirty else "")


class _Saver:
    """A result dict written to disk after every phase, so a killed child leaves what it had."""

    def __init__(self, path: str):
        self.path, self.data = path, {}

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def _gpt_step(autopar, gpt_loss, value_and_grad=None):
    vg = value_and_grad or autopar.value_and_grad

    def train_step(state, batch):
        def loss_fn(params):
            return gpt_loss(state.apply_fn(params, batch["tokens"]), batch["tokens"])
        loss, grads = vg(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
    return train_step


# ---------------------------------------------------------------------------------------------
# Worker 1: plan one (layers, hosts) case.
# ---------------------------------------------------------------------------------------------

def _plan_worker(args) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, REPO)
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import autopar
    from models.gpt import GPT, GPTConfig, gpt_loss, gpt_param_count

    layers, hosts = args.layers_, args.hosts_
    out = _Saver(args.result_)
    r = out.data
    r.update(layers=layers, hosts=hosts, load_start=_load())
    cfg = GPTConfig(num_layers=layers, **PLAN_CFG)
    r["params"] = gpt_param_count(cfg)
    model = GPT(cfg)

    def create():
        p = model.init(jax.random.key(0), jnp.zeros((1, cfg.seq_len), jnp.int32))
        return train_state.TrainState.create(apply_fn=model.apply, params=p,
                                             tx=optax.adam(1e-4))

    state = jax.eval_shape(create)
    step = _gpt_step(autopar, gpt_loss)
    cluster = autopar.ClusterSpec.preset(PRESET, num_hosts=hosts)
    r["num_devices"] = cluster.num_devices
    method = autopar.PipeshardParallel(
        num_microbatches=PLAN_MICROBATCHES,
        layer_option=autopar.AutoLayerOption(num_layers=args.auto_layers),
        stage_option=autopar.AutoStageOption(logical_shapes=args.shapes_))
    r["options"] = {"num_microbatches": PLAN_MICROBATCHES, "auto_layers": args.auto_layers,
                    "logical_shapes": args.shapes_, "schedule": method.schedule.value}
    r["attempts"] = []
    for batch_size in (args.plan_batch, PLAN_FALLBACK_BATCH):
        if r["attempts"] and batch_size >= r["attempts"][-1]["batch"]:
            break
        a = {"batch": batch_size}
        r["attempts"].append(a)
        out.save()
        _progress(f"plan L={layers} H={hosts} ({cluster.num_devices} devices) batch "
                  f"{batch_size}, shapes {args.shapes_}: planning ...")
        spec = {"tokens": jax.ShapeDtypeStruct((batch_size, cfg.seq_len), jnp.int32)}
        t0 = time.perf_counter()
        try:
            plan = autopar.plan(step, state, spec, cluster=cluster, method=method)
        except autopar.InfeasiblePlanError as e:
            a["wall_s"] = time.perf_counter() - t0
            a["infeasible"] = str(e)
            out.save()
            _progress(f"plan L={layers} H={hosts}: infeasible after {a['wall_s']:.1f} s: {e}")
            continue
        except Exception as e:  # reported, not hidden: the table says what failed
            a["wall_s"] = time.perf_counter() - t0
            a["error"] = f"{type(e).__name__}: {e}"
            out.save()
            _progress(f"plan L={layers} H={hosts}: FAILED: {a['error']}")
            break
        a["wall_s"] = time.perf_counter() - t0
        pl = plan.pipeline
        a["timings_s"] = dict(plan.timings_s)
        a["pipeline"] = {k: pl.get(k) for k in (
            "num_layers", "num_ilps", "num_reused", "dp_candidates", "dp_pruned", "dp_time_s",
            "bubble_fraction", "in_flight", "predicted_latency_s", "segments")}
        a["predicted_step_s"] = plan.predicted_step_s
        a["peak_memory_bytes"] = plan.peak_memory_bytes
        a["stages"] = [{"layers": list(s.layers), "submesh": list(s.submesh),
                        "logical": list(s.logical_mesh_shape), "devices": len(s.device_ids),
                        "latency_s": s.latency_s, "scopes": list(s.scopes)}
                       for s in plan.stages]
        out.save()
        _progress(f"plan L={layers} H={hosts}: {a['wall_s']:.1f} s, {len(plan.stages)} stages, "
                  f"{pl['num_ilps']} ILPs, predicted {plan.predicted_step_s * 1e3:.1f} ms")
        break
    r["load_end"] = _load()
    out.save()


# ---------------------------------------------------------------------------------------------
# Worker 2: run one pipeline (or the ShardParallel reference) on 8 simulated CPU devices.
# ---------------------------------------------------------------------------------------------

def _ideal(schedule, fwd_s, bwd_s, seg_s):
    """Ideal step times from per-task times (seconds).

    critical path: sum over the schedule's clocks of the longest task in that clock (stages
      run concurrently, a clock ends when its slowest task does), plus the apply-gradient
      segments run one after another;
    serial work: every task and segment one after another (what a machine whose stages share
      the same cores cannot beat when each task alone keeps all cores busy).
    """
    from autopar.runtime.schedule import Phase
    cp = 0.0
    for row in schedule.clocks:
        cp += max((fwd_s[s] if t.phase is Phase.FORWARD else bwd_s[s])
                  for s, t in enumerate(row) if t is not None)
    m = schedule.num_microbatches
    serial = m * (sum(fwd_s) + sum(bwd_s))
    segs = sum(seg_s)
    return cp + segs, serial + segs


def _run_worker(args) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={NUM_DEVICES}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, REPO)
    import collections
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import autopar
    from autopar.runtime.executor import Executor
    from models.gpt import GPT, GPTConfig, gpt_loss, gpt_param_count, make_gpt_batch

    what = args.stages_          # 0: ShardParallel reference; else the number of stages
    out = _Saver(args.result_)
    r = out.data
    r.update(stages=what, load_start=_load())
    devices = jax.devices()
    r["jax"] = {"version": jax.__version__, "platform": devices[0].platform,
                "device_count": len(devices)}
    if len(devices) < NUM_DEVICES:
        r["error"] = f"need {NUM_DEVICES} devices, jax sees {len(devices)}"
        out.save()
        return
    cfg = GPTConfig(stage_boundaries=True, **RUN_CFG)
    r["params"] = gpt_param_count(cfg)
    model = GPT(cfg)
    tx = optax.adam(1e-4)

    def create_state(key):
        params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    key = jax.random.key(0)
    state = jax.jit(create_state)(key)
    batch = make_gpt_batch(jax.random.fold_in(key, 1), RUN_BATCH, cfg)
    mesh = jax.make_mesh(MESH_SHAPE, AXIS_NAMES)
    step = _gpt_step(autopar, gpt_loss)
    if what:
        method = autopar.PipeshardParallel(
            num_microbatches=RUN_MICROBATCHES, schedule=autopar.Schedule.ONE_F_ONE_B,
            layer_option=autopar.ManualLayerOption(),
            stage_option=autopar.UniformStageOption(num_stages=what))
    else:
        method = autopar.ShardParallel()
    name = f"{what} stages" if what else "ShardParallel"
    par = autopar.parallelize(step, mesh=mesh, method=method)
    _progress(f"run {name}: planning ...")
    t0 = time.perf_counter()
    plan = par.get_plan(state, batch)
    r["plan_s"] = time.perf_counter() - t0
    r["predicted_step_s"] = plan.predicted_step_s
    if what:
        r["stages_info"] = [{"layers": list(s.layers), "devices": len(s.device_ids),
                             "logical": list(s.logical_mesh_shape), "latency_s": s.latency_s}
                            for s in plan.stages]
        r["bubble_fraction"] = plan.pipeline["bubble_fraction"]
    out.save()

    def timed_step(fn, *a):
        t0 = time.perf_counter()
        o = fn(*a)
        jax.block_until_ready(o)
        return time.perf_counter() - t0, o

    _progress(f"run {name}: first step (compiles) ...")
    r["first_step_s"], o = timed_step(par, state, batch)
    r["first_loss"] = float(o[1])
    out.save()
    _progress(f"run {name}: first step {r['first_step_s']:.1f} s, loss {r['first_loss']:.4f}")
    timed_step(par, state, batch)            # one more warm-up step
    if not what:
        times = []
        budget_t0 = time.perf_counter()
        for i in range(args.measure_steps):
            dt, o = timed_step(par, state, batch)
            times.append(dt)
            _progress(f"run {name}: step {i + 1}/{args.measure_steps} {dt:.3f} s")
            if len(times) >= 3 and time.perf_counter() - budget_t0 > args.measure_budget_s:
                break
        r["step_times_s"] = times
        r["measured_step_s"] = statistics.median(times)
        r["loss"] = float(o[1])
        r["load_end"] = _load()
        out.save()
        return

    # Per-task times: the same PipelineProgram run by a second executor whose stage
    # forward/backward and apply-gradient segment executables are wrapped to run alone
    # (inputs ready before the clock starts, outputs ready before it stops).
    prog = par.get_compiled(state, batch)
    rec: dict = collections.defaultdict(list)

    def wrap(fn, key):
        def timed(*a):
            jax.block_until_ready(a)
            c0, t0 = time.process_time(), time.perf_counter()
            res = fn(*a)
            jax.block_until_ready(res)
            rec[key].append((time.perf_counter() - t0, time.process_time() - c0))
            return res
        return timed

    stages = tuple(dataclasses.replace(s, forward=wrap(s.forward, ("F", s.index)),
                                       backward=wrap(s.backward, ("B", s.index)))
                   for s in prog.stages)
    segs = tuple(None if f is None else wrap(f, ("seg", j))
                 for j, f in enumerate(prog.segment_fns))
    sync = Executor(dataclasses.replace(prog, stages=stages, segment_fns=segs))
    leaves = jax.tree_util.tree_leaves((state, batch))
    flat = [jax.device_put(x, s) for x, s in zip(leaves, prog.in_shardings)]
    jax.block_until_ready(flat)
    timed_step(sync.run, flat)               # warm-up of the wrapped executor
    rec.clear()
    # Interleaved: a real step, then a one-task-at-a-time step, so that both see the same
    # load from whatever else runs on the machine.
    times, sync_times = [], []
    budget_t0 = time.perf_counter()
    for i in range(args.measure_steps):
        dt, o = timed_step(par, state, batch)
        times.append(dt)
        if i == 0:
            ex = par.get_executor(state, batch).stats
            r["executor_stats"] = {"num_dispatches": ex.num_dispatches,
                                   "num_transfers": ex.num_transfers,
                                   "max_live_microbatches": list(ex.max_live_microbatches)}
        dts, _ = timed_step(sync.run, flat)
        sync_times.append(dts)
        _progress(f"run {name}: round {i + 1}/{args.measure_steps}: step {dt:.3f} s, "
                  f"one task at a time {dts:.3f} s")
        if len(times) >= 3 and time.perf_counter() - budget_t0 > args.measure_budget_s:
            break
    r["step_times_s"] = times
    r["measured_step_s"] = statistics.median(times)
    r["loss"] = float(o[1])
    med = lambda key: statistics.median(w for w, _ in rec[key])   # noqa: E731
    n_st = len(prog.stages)
    fwd = [med(("F", s)) for s in range(n_st)]
    bwd = [med(("B", s)) for s in range(n_st)]
    seg = [med(k) for k in sorted(k for k in rec if k[0] == "seg")]
    cpu_util = {f"{k[0]}{k[1]}": sum(c for _, c in rec[k]) / max(sum(w for w, _ in rec[k]), 1e-9)
                for k in rec}
    r["tasks"] = {"forward_s": fwd, "backward_s": bwd, "segments_s": seg,
                  "forward_min_s": [min(w for w, _ in rec[("F", s)]) for s in range(n_st)],
                  "backward_min_s": [min(w for w, _ in rec[("B", s)]) for s in range(n_st)],
                  "samples_per_task": len(rec[("F", 0)]),
                  "cpu_per_wall": cpu_util,
                  "sync_step_times_s": sync_times,
                  "sync_step_s": statistics.median(sync_times),
                  "sum_tasks_per_step_s": sum(w for k in rec for w, _ in rec[k])
                  / max(len(sync_times), 1)}
    cp, serial = _ideal(prog.schedule, fwd, bwd, seg)
    r["ideal_critical_path_s"] = cp
    r["ideal_serial_s"] = serial
    r["load_end"] = _load()
    out.save()
    _progress(f"run {name}: measured {r['measured_step_s'] * 1e3:.0f} ms, ideal critical path "
              f"{cp * 1e3:.0f} ms, serial work {serial * 1e3:.0f} ms")


# ---------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------

def _child(argv: list[str], label: str, timeout_s: float) -> dict:
    fd, path = tempfile.mkstemp(prefix="autopar_pipeline_", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--_result", path]
    _progress(f"{label}: starting worker")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    outcome = None
    try:
        rc = proc.wait(timeout=timeout_s)
        if rc != 0:
            outcome = f"worker exited with status {rc}" + (
                " (killed by the OS: out of memory?)" if rc in (-9, 137) else "")
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        outcome = f"stopped after the per-case limit of {timeout_s:.0f} s"
    result: dict = {}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        os.unlink(path)
    if outcome:
        result["incomplete"] = outcome
    result["process_wall_s"] = time.perf_counter() - t0
    _progress(f"{label}: done in {result['process_wall_s']:.1f} s"
              + (f" ({outcome})" if outcome else ""))
    return result


def run(args) -> dict:
    """Run every selected case; returns the results for `section`."""
    started = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    t0 = time.perf_counter()
    res: dict = {"started_utc": started, "plan": [], "run": [], "load_start": _load(),
                 "revision_start": _source_revision()}
    if not args.no_plan:
        for layers in args.plan_layers:
            for hosts in args.plan_hosts:
                shapes = args.shapes_1host if hosts == 1 else args.shapes_multihost
                res["plan"].append(_child(
                    ["--_plan", str(layers), str(hosts), "--_shapes", shapes,
                     "--auto-layers", str(args.auto_layers), "--plan-batch",
                     str(args.plan_batch)],
                    f"plan L={layers} H={hosts}", args.case_timeout_s))
                res["plan"][-1].setdefault("layers", layers)
                res["plan"][-1].setdefault("hosts", hosts)
                res["plan"][-1].setdefault("shapes", shapes)
    if not args.no_run:
        for what in [*args.stages, *([] if args.no_shard_reference else [0])]:
            common = ["--measure-steps", str(args.measure_steps),
                      "--pipeline-measure-budget-s", str(args.measure_budget_s)]
            res["run"].append(_child(["--_run", str(what), *common],
                                     f"run {what or 'ShardParallel'}", args.case_timeout_s))
            res["run"][-1].setdefault("stages", what)
    res["total_s"] = time.perf_counter() - t0
    res["load_end"] = _load()
    res["revision_end"] = _source_revision()
    res["cmdline"] = args.cmdline
    res["args"] = {k: getattr(args, k) for k in ("auto_layers", "shapes_1host",
                                                  "shapes_multihost", "plan_batch",
                                                  "measure_steps")}
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(res, f, indent=1)
    return res


# ---------------------------------------------------------------------------------------------
# Markdown.
# ---------------------------------------------------------------------------------------------

def _f(x, digits=2, scale=1.0) -> str:
    if x is None:
        return "–"
    return f"{x * scale:,.{digits}f}"


def _ms(x, digits=1) -> str:
    return "–" if x is None else f"{x * 1e3:,.{digits}f}"


def _pct(x) -> str:
    return "–" if x is None else f"{x * 100:+.1f}%"


def _stage_str(stages) -> str:
    parts = []
    for s in stages:
        a, b = s["layers"]
        span = f"{a}" if a == b else f"{a}-{b}"
        t = s["latency_s"]
        parts.append(f"L{span}: {s['submesh'][0]}x{s['submesh'][1]} "
                     f"({s['logical'][0]}x{s['logical'][1]}) "
                     + (f"{t * 1e3:.1f} ms" if t >= EMPTY_S else "**~0 ms**"))
    return "; ".join(parts)


def section(res: dict) -> str:
    jx = next((r["jax"] for r in res["run"] if "jax" in r), None)
    ram = _mem_total_bytes()
    a = res["args"]
    out = [BEGIN, "## Pipeline (PipeshardParallel)", "",
           f"Generated by `{res['cmdline']}` on {res['started_utc']} UTC; this section took "
           f"{res['total_s'] / 60:.1f} min. Machine: {os.cpu_count()} CPU cores "
           f"(`{_cpu_model()}`), {ram / 2**30:.1f} GiB RAM, `{platform.platform()}`, Python "
           f"{platform.python_version()}" + (f", jax {jx['version']}" if jx else "") + ". "
           f"Load average (1, 5, 15 min) at the start {res['load_start']}, at the end "
           f"{res['load_end']}: other processes on the machine compete for the same cores, "
           "so every time below is wall time under that load.", "",
           f"Source: `{_revision_text(res)}`.", ""]

    # --- planning ---
    if res["plan"]:
        out += ["### Planning time (64 GPUs planned from a 2-core CPU)", "",
                f"GPT (`models/gpt.py`): hidden {PLAN_CFG['hidden']}, {PLAN_CFG['num_heads']} "
                f"heads, seq {PLAN_CFG['seq_len']}, vocab {PLAN_CFG['vocab_size']}, "
                f"`TrainState` + `optax.adam`, step with `autopar.value_and_grad`; state from "
                f"`jax.eval_shape` (nothing allocated). `autopar.plan(..., cluster="
                f"ClusterSpec.preset(\"{PRESET}\", num_hosts=H), method=PipeshardParallel("
                f"num_microbatches={PLAN_MICROBATCHES}, layer_option=AutoLayerOption(num_layers="
                f"{a['auto_layers']}), stage_option=AutoStageOption(logical_shapes=...)))` with "
                f"the default 1F1B schedule. Options: `logical_shapes=\"{a['shapes_1host']}\"` "
                f"on 1 host (8 devices: submeshes 1x1, 1x2, 1x4, 1x8), "
                f"`\"{a['shapes_multihost']}\"` on 8 hosts (64 devices: 1x1, 1x2, 1x4, 1x8, "
                f"2x8 .. 8x8), chosen to keep the section near 10 minutes on this machine; "
                f"\"flat\" tries only the (1, n) and (n, 1) views of each submesh. Global "
                f"batch {a['plan_batch']}; a case that is infeasible at {a['plan_batch']} "
                f"(does not fit 16 GB per V100) is planned again at {PLAN_FALLBACK_BATCH} and "
                f"the batch column says which was used.", "",
                "`plan s` is the wall time of `autopar.plan`; `trace` and `inter-op` come from "
                "`plan.timings_s` (inter-op = per-(layer, submesh, view) stage ILPs + the "
                "stage DP + the chosen stages' final ILPs + apply-gradient placement); `DP` is "
                "`plan.pipeline[\"dp_time_s\"]`; ILPs solved / reused are "
                "`plan.pipeline[\"num_ilps\"]` / `[\"num_reused\"]` (reused: answered from the "
                "cache of identical layer graphs). Stages: `L<layers>: <hosts>x<devices per "
                "host> (<logical mesh data x model>) <predicted fwd+bwd per microbatch>`; a "
                "stage predicted at **~0 ms** (under 1 us) has no heavy operator (see the "
                "notes).", "",
                "| layers | params (M) | hosts | devices | shapes | batch | plan s | trace s | "
                "inter-op s | DP ms | ILPs solved | reused | stages | predicted step ms | "
                "predicted bubble | peak GiB/device | stages: layers, submesh, logical mesh, "
                "fwd+bwd/mb |",
                "|---:|---:|---:|---:|:--|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
                "---:|:--|"]
        for r in res["plan"]:
            atts = r.get("attempts", [])
            ok = next((x for x in atts if "stages" in x), None)
            notes = []
            for x in atts:
                if "infeasible" in x:
                    notes.append(f"batch {x['batch']}: InfeasiblePlanError after "
                                 f"{x['wall_s']:.1f} s ({_short(x['infeasible'])})")
                if "error" in x:
                    notes.append(f"batch {x['batch']}: **failed** after {x['wall_s']:.1f} s: "
                                 f"{_short(x['error'], 300)}")
            if r.get("incomplete"):
                notes.append(r["incomplete"])
            opts = r.get("options", {})
            row = [str(r["layers"]), _f(r.get("params"), 0, 1e-6), str(r["hosts"]),
                   str(r.get("num_devices", "–")), f"`{opts.get('logical_shapes', r['shapes'])}`"]
            if ok:
                tm, pl = ok["timings_s"], ok["pipeline"]
                row += [str(ok["batch"]), _f(ok["wall_s"], 1), _f(tm.get("trace"), 1),
                        _f(tm.get("inter_op"), 1), _f(pl["dp_time_s"], 1, 1e3),
                        str(pl["num_ilps"]), str(pl["num_reused"]), str(len(ok["stages"])),
                        _ms(ok["predicted_step_s"]), f"{pl['bubble_fraction']:.1%}",
                        _f(ok["peak_memory_bytes"], 2, 2**-30),
                        _stage_str(ok["stages"]) + ("; " + "; ".join(notes) if notes else "")]
            else:
                row += ["–"] * 11 + ["not planned: " + ("; ".join(notes) or "no result")]
            out.append("| " + " | ".join(row) + " |")
        out.append("")

    # --- measured ---
    if res["run"]:
        out += ["### Measured pipeline step and executor overhead (8 simulated CPU devices)", "",
                f"GPT: hidden {RUN_CFG['hidden']}, {RUN_CFG['num_heads']} heads, seq "
                f"{RUN_CFG['seq_len']}, vocab {RUN_CFG['vocab_size']}, {RUN_CFG['num_layers']} "
                f"blocks with `stage_boundaries=True` and `ManualLayerOption()` (one layer per "
                f"block; the embedding is in layer 0, the head and loss in the last), batch "
                f"{RUN_BATCH}, `optax.adam`; `autopar.parallelize(step, mesh=jax.make_mesh("
                f"{MESH_SHAPE}, {AXIS_NAMES}), method=PipeshardParallel(num_microbatches="
                f"{RUN_MICROBATCHES}, schedule=Schedule.ONE_F_ONE_B, layer_option="
                f"ManualLayerOption(), stage_option=UniformStageOption(num_stages=S)))` with "
                f"`XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES}`; the "
                f"ShardParallel row is the same step with `method=ShardParallel()`.", "",
                "Method. **measured**: median wall time of the steps (each ended by "
                "`jax.block_until_ready`) after the first (compiling) step and one more "
                "warm-up step; `n` is how many. **Task times**: the program from "
                "`par.get_compiled(state, batch)` (a `PipelineProgram`) is also run by a "
                "fresh `autopar.runtime.executor.Executor` over a copy whose stage "
                "`forward`/`backward` and apply-gradient segment executables are wrapped: each "
                "call waits for its inputs, then times the call until its outputs are ready. So "
                "every task runs alone, on real inputs, in the schedule's order (including the "
                "first backward, whose accumulator is empty). After one warm-up step of each, "
                "the timed steps alternate with these one-task-at-a-time steps (so both see "
                "the same load), and the per-(stage, phase) median over all of them is used. "
                "**Ideal (critical path)**: sum over the clocks of "
                "`autopar.runtime.make_schedule(1F1B, S, M)` of the longest task in that clock, "
                "plus the apply-gradient segments one after another: the step time if stages "
                "ran concurrently on their own devices and the executor cost nothing. "
                "**Ideal (serial)**: every task and segment one after another. "
                "**Overhead** = measured / ideal - 1. `sync step` is the median wall time of the "
                "wrapped (one task at a time) steps; `sync - tasks` is the time they spend "
                "outside the timed executables (the executor's own work: dispatch, "
                "microbatch split, cotangent sums, transfers between submeshes), as a share of "
                "the tasks' time: (sum of the sync steps - sum of every task in them) / sum of "
                "every task. `measured / sync step, per round`: the real step over the "
                "one-task-at-a-time step that followed it (a ratio taken under nearly the same "
                "load); above 1 means running the stages concurrently was slower than running "
                "one task at a time.", "",
                "Per-task times and ideal step times:", "",
                "| method | devices per stage | fwd ms per stage | bwd ms per stage | "
                "apply-grad ms (segments) | cores busy per task | ideal critical path ms | "
                "ideal serial ms | predicted ms | first step s (compiles) |",
                "|:--|---:|:--|:--|---:|:--|---:|---:|---:|---:|"]
        steps_rows = ["Measured step time and overhead:", "",
                      "| method | measured ms (min) | n | overhead vs critical path | "
                      "overhead vs serial | sync step ms | sync - tasks | measured / sync step "
                      "(median over rounds) | steps s (measured; sync) | loss | dispatches / "
                      "transfers | max live microbatches |",
                      "|:--|---:|---:|---:|---:|---:|---:|---:|:--|---:|---:|:--|"]
        for r in res["run"]:
            what = r.get("stages")
            label = f"Pipeshard, {what} stages" if what else "ShardParallel (reference)"
            meas = r.get("measured_step_s")
            tk = r.get("tasks")
            notes = "; ".join(x for x in (r.get("incomplete"), r.get("error")) if x)
            mtxt = (f"{_ms(meas)} ({_ms(min(r['step_times_s']))})" if meas is not None
                    else "not measured" + (f": {notes}" if notes else ""))
            steps = ", ".join(f"{x:.2f}" for x in r.get("step_times_s", [])) or "–"
            if tk:
                cp, ser = r["ideal_critical_path_s"], r["ideal_serial_s"]
                busy = [v for k, v in tk["cpu_per_wall"].items() if not k.startswith("seg")]
                sync, tsum = tk["sync_step_s"], tk["sum_tasks_per_step_s"]
                sync_mean = statistics.mean(tk["sync_step_times_s"])
                ex = r.get("executor_stats", {})
                out.append("| " + " | ".join([
                    label, ", ".join(str(s["devices"]) for s in r.get("stages_info", [])),
                    " / ".join(_ms(x) for x in tk["forward_s"]),
                    " / ".join(_ms(x) for x in tk["backward_s"]),
                    f"{_ms(sum(tk['segments_s']))} ({len(tk['segments_s'])})",
                    f"{min(busy):.2f}-{max(busy):.2f}", _ms(cp, 0), _ms(ser, 0),
                    _ms(r.get("predicted_step_s")), _f(r.get("first_step_s"), 1)]) + " |")
                ratio = statistics.median(
                    m / q for m, q in zip(r["step_times_s"], tk["sync_step_times_s"]))
                steps_rows.append("| " + " | ".join([
                    label, mtxt, str(len(r["step_times_s"])), _pct(meas / cp - 1),
                    _pct(meas / ser - 1), _ms(sync, 0), _pct((sync_mean - tsum) / tsum),
                    _f(ratio, 2),
                    steps + "; " + ", ".join(f"{x:.2f}" for x in tk["sync_step_times_s"]),
                    _f(r.get("loss"), 4),
                    f"{ex.get('num_dispatches', '–')} / {ex.get('num_transfers', '–')}",
                    ", ".join(map(str, ex.get("max_live_microbatches", [])))]) + " |")
            else:
                out.append("| " + " | ".join([
                    label, "8 (one mesh)" if not what else "–", "–", "–", "–", "–", "–", "–",
                    _ms(r.get("predicted_step_s")), _f(r.get("first_step_s"), 1)]) + " |")
                steps_rows.append("| " + " | ".join([
                    label, mtxt, str(len(r.get("step_times_s", []))), "–", "–", "–", "–",
                    "–", steps, _f(r.get("loss"), 4), "–", "–"]) + " |")
        out += ["", *steps_rows, ""]
    out += ["### Notes", "", *_notes(res), "", END]
    return "\n".join(out)


def _revision_text(res) -> str:
    a, b = res.get("revision_start"), res.get("revision_end")
    if a is None:
        return "not recorded"
    return a if a == b else (f"{a} at the start, {b} at the end: the source changed during "
                             "the run")


def _short(text: str, n: int = 160) -> str:
    text = re.sub(r"\s+", " ", str(text)).replace("|", "/")
    return text if len(text) <= n else text[:n] + " ..."


def _notes(res) -> list[str]:
    lines = []
    empty = []
    for r in res["plan"]:
        ok = next((x for x in r.get("attempts", []) if "stages" in x), None)
        if ok:
            n0 = [s for s in ok["stages"] if s["latency_s"] < EMPTY_S]
            if n0:
                empty.append(f"{r['layers']} layers on {r['hosts']} host(s): {len(n0)} of "
                             f"{len(ok['stages'])} stages, "
                             f"{sum(s['devices'] for s in n0)} of {r.get('num_devices')} "
                             "devices")
    if empty:
        lines.append("- Stages predicted at ~0 ms hold layers without any heavy operator: "
                     "`AutoLayerOption` minimizes the bytes crossing the cuts under an upper "
                     "bound on each layer's FLOPs only, and the head (vocab 51200: one matmul "
                     "of about 3.5 blocks' FLOPs) forces that bound to be relaxed, after which "
                     "cuts next to the graph's ends (where almost nothing crosses) are the "
                     "cheapest; the stage DP then gives such layers devices of their own. "
                     "Seen here: " + "; ".join(empty) + ".")
    runs = [r for r in res["run"] if r.get("tasks")]
    if runs:
        lines.append(f"- The machine has {os.cpu_count()} cores for {NUM_DEVICES} simulated "
                     "devices, so the stages of a pipeline do not run on their own hardware: "
                     "they share the same cores (`cores busy per task` is CPU time / wall time "
                     "of one task running alone). The critical-path ideal assumes they do not "
                     "share, so `overhead vs critical path` is mostly this sharing, not the "
                     "executor; `overhead vs serial` and `sync - tasks` bound the executor's "
                     "own cost on this machine. Negative overhead vs serial means stages did "
                     "overlap on the spare core time.")
    if runs:
        parts = {"critical-path ideal": [], "serial ideal": [],
                 "one-task-at-a-time step (sync - tasks)": []}
        small = []
        for r in runs:
            tk, meas = r["tasks"], r["measured_step_s"]
            lab = f"{r['stages']} stages"
            parts["critical-path ideal"].append((lab, meas / r["ideal_critical_path_s"] - 1))
            parts["serial ideal"].append((lab, meas / r["ideal_serial_s"] - 1))
            tsum = tk["sum_tasks_per_step_s"]
            parts["one-task-at-a-time step (sync - tasks)"].append(
                (lab, (statistics.mean(tk["sync_step_times_s"]) - tsum) / tsum))
            shortest = min(tk["forward_s"] + tk["backward_s"])
            if shortest < 0.010:
                small.append(f"{lab}: shortest task {shortest * 1e3:.1f} ms")
        verdicts = []
        for name, vals in parts.items():
            ok = all(v < 0.10 for _, v in vals)
            verdicts.append(f"{name}: {'holds' if ok else 'does NOT hold'} ("
                            + ", ".join(f"{lab} {_pct(v)}" for lab, v in vals) + ")")
        lines.append("- **Executor overhead under 10% once a task takes >= 10 ms** ("
                     + ("every task here takes >= 10 ms" if not small else
                        "some tasks are shorter: " + "; ".join(small)) + "): "
                     + "; ".join(verdicts) + ".")
    lines.append("- Nothing here is filled in by hand: `benchmarks/pipeline.py` wrote it from "
                 "one run.")
    return lines


def read_section(path: str) -> str | None:
    """The pipeline section of `path` (markers included), or None."""
    try:
        with open(path) as f:
            old = f.read()
    except OSError:
        return None
    if BEGIN in old and END in old:
        return old[old.index(BEGIN):old.index(END) + len(END)]
    return None


def write_section(text: str, path: str) -> None:
    """Put the section into `path`: replace the old one, else insert it before `## GPU`, else
    append."""
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + text + old[old.index(END) + len(END):]
    elif "\n## GPU" in old:
        i = old.index("\n## GPU") + 1
        new = old[:i] + text + "\n\n" + old[i:]
    else:
        new = (old.rstrip("\n") + "\n\n" if old else "") + text + "\n"
    with open(path, "w") as f:
        f.write(new)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The pipeline options (also accepted by run_all.py)."""
    g = p.add_argument_group("pipeline section")
    g.add_argument("--plan-layers", type=int, nargs="+", default=list(PLAN_LAYERS))
    g.add_argument("--plan-hosts", type=int, nargs="+", default=list(PLAN_HOSTS))
    g.add_argument("--plan-batch", type=int, default=PLAN_BATCH)
    g.add_argument("--auto-layers", type=int, default=8, help="AutoLayerOption(num_layers=)")
    g.add_argument("--shapes-1host", default="all", choices=("all", "flat"))
    g.add_argument("--shapes-multihost", default="flat", choices=("all", "flat"))
    g.add_argument("--stages", type=int, nargs="+", default=list(RUN_STAGES),
                   help="UniformStageOption(num_stages=) of the measured runs")
    g.add_argument("--measure-steps", type=int, default=7,
                   help="timed steps (each followed by a one-task-at-a-time step)")
    g.add_argument("--pipeline-measure-budget-s", dest="measure_budget_s", type=float,
                   default=60.0, help="stop timing steps after this long (at least 3)")
    g.add_argument("--no-plan", action="store_true", help="skip the planning part")
    g.add_argument("--no-run", action="store_true", help="skip the measured part")
    g.add_argument("--no-shard-reference", action="store_true")
    g.add_argument("--case-timeout-s", type=float, default=900.0)
    g.add_argument("--save-json", default=None, help="also write the raw results here")


def main(argv=None, cmdline: str | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    add_arguments(p)
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="markdown file whose pipeline section is (re)written")
    p.add_argument("--from-json", default=None,
                   help="render the section from raw results saved by --save-json (runs "
                        "nothing)")
    p.add_argument("--_plan", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_shapes", default="all", help=argparse.SUPPRESS)
    p.add_argument("--_run", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.result_ = args._result
    if args._plan is not None:
        args.layers_, args.hosts_ = args._plan
        args.shapes_ = args._shapes
        _plan_worker(args)
        return 0
    if args._run is not None:
        args.stages_ = args._run
        _run_worker(args)
        return 0
    args.cmdline = cmdline or ("benchmarks/pipeline.py " + " ".join(
        sys.argv[1:] if argv is None else argv)).strip()
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
    else:
        res = run(args)
    text = section(res)
    write_section(text, args.out)
    _progress(f"wrote the pipeline section of {args.out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
