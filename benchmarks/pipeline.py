"""autopar pipeline benchmark (PipeshardParallel): planning cost and executor overhead.

Run from the repository root; it rewrites benchmarks/results/pipeline.md:

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
reference, and under ShardParallel(num_microbatches=M) for each `--accumulate` M (default 4):
gradient accumulation, which autopar runs as a one-stage pipeline on the whole mesh; its step
time is compared with the reference's, its predicted peak memory per device and first loss too.

Each case runs in its own child process (memory returned, a stuck case killed after
`--case-timeout-s`); progress goes to stderr. Nothing is invented: what was not measured says
so and why.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from common import (
    AXIS_NAMES,
    MESH_SHAPE,
    NUM_DEVICES,
    Saver,
    gpt_state_fn,
    gpt_train_step,
    load_avg,
    progress,
    results,
    run_case,
    setup_worker,
    source_revision,
    utc_now,
    write_result,
)
from pipeline_report import (
    DEFAULT_OUT,
    PLAN_CFG,
    PLAN_FALLBACK_BATCH,
    PLAN_MICROBATCHES,
    PRESET,
    RUN_BATCH,
    RUN_CFG,
    RUN_MICROBATCHES,
    _short,
    section,
)

# Defaults of the options (the workload itself is described in pipeline_report.py).
PLAN_LAYERS = (12, 24, 48)
PLAN_HOSTS = (1, 8)
PLAN_BATCH = 32
RUN_STAGES = (2, 4)


def _progress(msg: str) -> None:
    progress("pipeline", msg)


# ---------------------------------------------------------------------------------------------
# Worker 1: plan one (layers, hosts) case.
# ---------------------------------------------------------------------------------------------

def _plan_worker(args) -> None:
    setup_worker()
    import jax
    import jax.numpy as jnp
    import optax

    import autopar
    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, gpt_param_count

    layers, hosts = args.layers_, args.hosts_
    out = Saver(args.result_)
    r = out.data
    r.update(layers=layers, hosts=hosts, load_start=load_avg())
    cfg = GPTConfig(num_layers=layers, **PLAN_CFG)
    r["params"] = gpt_param_count(cfg)
    model = GPT(cfg)
    state = jax.eval_shape(gpt_state_fn(model, optax.adam(1e-4), cfg.seq_len),
                           jax.random.key(0))
    step = gpt_train_step(gpt_loss, autopar.value_and_grad)
    cluster = autopar.ClusterSpec.preset(PRESET, num_hosts=hosts)
    r["num_devices"] = cluster.num_devices
    method = autopar.PipeshardParallel(
        num_microbatches=PLAN_MICROBATCHES,
        layer_option=autopar.AutoLayerOption(num_layers=args.auto_layers),
        stage_option=autopar.AutoStageOption(logical_shapes=args.shapes_,
                                             workers=args._workers))
    from autopar.inter_op.parallel import plan_workers
    r["options"] = {"num_microbatches": PLAN_MICROBATCHES, "auto_layers": args.auto_layers,
                    "logical_shapes": args.shapes_, "schedule": method.schedule.value,
                    "workers": plan_workers(args._workers)}
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
    r["load_end"] = load_avg()
    out.save()


# ---------------------------------------------------------------------------------------------
# Worker 2: run one pipeline (or ShardParallel, with or without gradient accumulation) on 8
# simulated CPU devices.
# ---------------------------------------------------------------------------------------------

def _ideal(schedule, fwd_s, bwd_s, seg_s):
    """Ideal step times from per-task times (seconds).

    critical path: sum over the schedule's clocks of the longest task in that clock (stages
      run concurrently, a clock ends when its slowest task does), plus the apply-gradient
      segments run one after another;
    serial work: every task and segment one after another (what a machine whose stages share
      the same cores cannot beat when each task alone keeps all cores busy).
    """
    from autopar.inter_op.schedule import Phase
    cp = 0.0
    for row in schedule.clocks:
        cp += max((fwd_s[s] if t.phase is Phase.FORWARD else bwd_s[s])
                  for s, t in enumerate(row) if t is not None)
    m = schedule.num_microbatches
    serial = m * (sum(fwd_s) + sum(bwd_s))
    segs = sum(seg_s)
    return cp + segs, serial + segs


def _run_worker(args) -> None:
    out = Saver(args.result_)
    try:
        _run_case(args, out)
    except Exception as e:      # recorded for the report, then the worker fails as before
        out.data["error"] = f"{type(e).__name__}: {_short(e, 300)}"
        out.save()
        raise


def _run_case(args, out: Saver) -> None:
    setup_worker(NUM_DEVICES)
    import collections
    import dataclasses

    import jax
    import optax

    import autopar
    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, gpt_param_count, make_gpt_batch
    from autopar.runtime.executor import Executor

    what = args.stages_          # 0: ShardParallel; else the number of stages
    acc = args.accumulate_       # ShardParallel(num_microbatches=acc) when given (what is 0)
    r = out.data
    r.update(stages=what, load_start=load_avg())
    if not what:
        r["num_microbatches"] = acc or 1
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
    key = jax.random.key(0)
    state = jax.jit(gpt_state_fn(model, optax.adam(1e-4), cfg.seq_len))(key)
    batch = make_gpt_batch(jax.random.fold_in(key, 1), RUN_BATCH, cfg)
    mesh = jax.make_mesh(MESH_SHAPE, AXIS_NAMES)
    step = gpt_train_step(gpt_loss, autopar.value_and_grad)
    if what:
        method = autopar.PipeshardParallel(
            num_microbatches=RUN_MICROBATCHES, schedule=autopar.Schedule.ONE_F_ONE_B,
            layer_option=autopar.ManualLayerOption(),
            stage_option=autopar.UniformStageOption(num_stages=what))
    elif acc:
        method = autopar.ShardParallel(num_microbatches=acc)
    else:
        method = autopar.ShardParallel()
    name = f"{what} stages" if what else "ShardParallel" + (f" M={acc}" if acc else "")
    par = autopar.parallelize(step, mesh=mesh, method=method)
    _progress(f"run {name}: planning ...")
    t0 = time.perf_counter()
    plan = par.get_plan(state, batch)
    r["plan_s"] = time.perf_counter() - t0
    r["predicted_step_s"] = plan.predicted_step_s
    r["peak_memory_bytes"] = plan.peak_memory_bytes
    if acc:
        pl = plan.pipeline or {}
        r["gradient_accumulation"] = pl.get("gradient_accumulation")
        r["num_microbatches"] = pl.get("num_microbatches")
        r["num_plan_stages"] = len(plan.stages)
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
            if len(times) >= 3 and time.perf_counter() - budget_t0 > args.pipeline_measure_budget_s:
                break
        r["step_times_s"] = times
        r["measured_step_s"] = statistics.median(times)
        r["loss"] = float(o[1])
        r["load_end"] = load_avg()
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
                                       backward=wrap(s.backward, ("B", s.index)),
                                       fused=wrap(s.fused, ("T", s.index)))
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
        if len(times) >= 3 and time.perf_counter() - budget_t0 > args.pipeline_measure_budget_s:
            break
    r["step_times_s"] = times
    r["measured_step_s"] = statistics.median(times)
    r["loss"] = float(o[1])
    med = lambda key: statistics.median(w for w, _ in rec[key])   # noqa: E731
    n_st = len(prog.stages)
    # A stage whose forward and backward run as one fused call (the last under 1F1B): its
    # call's time counts as the forward, its backward as 0.
    fused = [s for s in range(n_st) if ("F", s) not in rec and ("T", s) in rec]
    fwd = [med(("T" if s in fused else "F", s)) for s in range(n_st)]
    bwd = [0.0 if s in fused else med(("B", s)) for s in range(n_st)]
    tmin = lambda key: min(w for w, _ in rec[key])   # noqa: E731
    seg = [med(k) for k in sorted(k for k in rec if k[0] == "seg")]
    cpu_util = {f"{k[0]}{k[1]}": sum(c for _, c in rec[k]) / max(sum(w for w, _ in rec[k]), 1e-9)
                for k in rec}
    r["tasks"] = {"forward_s": fwd, "backward_s": bwd, "segments_s": seg,
                  "forward_min_s": [tmin(("T" if s in fused else "F", s)) for s in range(n_st)],
                  "backward_min_s": [0.0 if s in fused else tmin(("B", s))
                                     for s in range(n_st)],
                  "fused_stages": fused,
                  "samples_per_task": len(rec[("F", 0)]),
                  "cpu_per_wall": cpu_util,
                  "sync_step_times_s": sync_times,
                  "sync_step_s": statistics.median(sync_times),
                  "sum_tasks_per_step_s": sum(w for k in rec for w, _ in rec[k])
                  / max(len(sync_times), 1)}
    cp, serial = _ideal(prog.schedule, fwd, bwd, seg)
    r["ideal_critical_path_s"] = cp
    r["ideal_serial_s"] = serial
    r["load_end"] = load_avg()
    out.save()
    _progress(f"run {name}: measured {r['measured_step_s'] * 1e3:.0f} ms, ideal critical path "
              f"{cp * 1e3:.0f} ms, serial work {serial * 1e3:.0f} ms")


# ---------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------

def _child(argv: list[str], label: str, timeout_s: float) -> dict:
    return run_case(os.path.abspath(__file__), argv, label, timeout_s, "autopar_pipeline_",
                    _progress)


def run(args) -> dict:
    """Run every selected case; returns the results for `section`."""
    t0 = time.perf_counter()
    res: dict = {"started_utc": utc_now(), "plan": [], "plan_workers": [], "run": [],
                 "accumulate": [],
                 "load_start": load_avg(), "revision_start": source_revision()}
    if not args.no_plan:
        # The main table with one worker (in-process), then the cases of `--workers-layers`
        # again with `--workers` worker processes, side by side in the same run.
        cases = [(layers, hosts, 1) for layers in args.plan_layers for hosts in args.plan_hosts]
        cases += [(layers, hosts, args.workers) for layers in args.workers_layers
                  for hosts in args.plan_hosts if args.workers > 1]
        for layers, hosts, workers in cases:
            shapes = args.shapes_1host if hosts == 1 else args.shapes_multihost
            r = _child(["--_plan", str(layers), str(hosts), "--_shapes", shapes,
                        "--_workers", str(workers), "--auto-layers", str(args.auto_layers),
                        "--plan-batch", str(args.plan_batch)],
                       f"plan L={layers} H={hosts} workers={workers}", args.case_timeout_s)
            r.update({k: v for k, v in (("layers", layers), ("hosts", hosts),
                                         ("shapes", shapes)) if k not in r})
            r["workers"] = workers
            res["plan" if workers == 1 else "plan_workers"].append(r)
    if not args.no_run:
        opts = ["--measure-steps", str(args.measure_steps),
                "--pipeline-measure-budget-s", str(args.pipeline_measure_budget_s)]
        for what in [*args.stages, *([] if args.no_shard_reference else [0])]:
            res["run"].append(_child(["--_run", str(what), *opts],
                                     f"run {what or 'ShardParallel'}", args.case_timeout_s))
            res["run"][-1].setdefault("stages", what)
        for m in [] if args.no_accumulate else args.accumulate:
            res["accumulate"].append(_child(["--_run", "0", "--_accumulate", str(m), *opts],
                                            f"run ShardParallel M={m}", args.case_timeout_s))
            res["accumulate"][-1].setdefault("stages", 0)
            res["accumulate"][-1].setdefault("num_microbatches", m)
    res["total_s"] = time.perf_counter() - t0
    res["load_end"] = load_avg()
    res["revision_end"] = source_revision()
    res["cmdline"] = args.cmdline
    res["args"] = {k: getattr(args, k) for k in ("auto_layers", "workers", "shapes_1host",
                                                  "shapes_multihost", "plan_batch",
                                                  "measure_steps")}
    res["args"]["accumulate"] = [] if args.no_accumulate else args.accumulate
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(res, f, indent=1)
    return res


# ---------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The pipeline options (also accepted by run_all.py)."""
    g = p.add_argument_group("pipeline benchmark")
    g.add_argument("--plan-layers", type=int, nargs="+", default=list(PLAN_LAYERS))
    g.add_argument("--plan-hosts", type=int, nargs="+", default=list(PLAN_HOSTS))
    g.add_argument("--plan-batch", type=int, default=PLAN_BATCH)
    g.add_argument("--auto-layers", type=int, default=8, help="AutoLayerOption(num_layers=)")
    g.add_argument("--workers", type=int, default=2,
                   help="AutoStageOption(workers=) of the side-by-side planning table (the "
                        "main table plans with 1; 1 here skips the table)")
    g.add_argument("--workers-layers", type=int, nargs="*", default=[12, 24],
                   help="layer counts planned again with --workers worker processes")
    g.add_argument("--shapes-1host", default="all", choices=("all", "flat"))
    g.add_argument("--shapes-multihost", default="flat", choices=("all", "flat"))
    g.add_argument("--stages", type=int, nargs="+", default=list(RUN_STAGES),
                   help="UniformStageOption(num_stages=) of the measured runs")
    g.add_argument("--measure-steps", type=int, default=7,
                   help="timed steps (each followed by a one-task-at-a-time step)")
    g.add_argument("--pipeline-measure-budget-s", dest="pipeline_measure_budget_s", type=float,
                   default=60.0, help="stop timing steps after this long (at least 3)")
    g.add_argument("--no-plan", action="store_true", help="skip the planning part")
    g.add_argument("--no-run", action="store_true", help="skip the measured part")
    g.add_argument("--no-shard-reference", action="store_true")
    g.add_argument("--accumulate", type=int, nargs="*", default=[4], metavar="M",
                   help="also measure ShardParallel(num_microbatches=M) (gradient "
                        "accumulation) for each M; none: skip")
    g.add_argument("--no-accumulate", action="store_true", help="same as --accumulate alone")
    g.add_argument("--case-timeout-s", type=float, default=900.0)
    g.add_argument("--save-json", default=None, help="also write the raw results here")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    add_arguments(p)
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="the Markdown file to write (default: benchmarks/results/pipeline.md)")
    p.add_argument("--from-json", default=None,
                   help="render the report from raw results saved by --save-json (runs "
                        "nothing)")
    p.add_argument("--_plan", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_shapes", default="all", help=argparse.SUPPRESS)
    p.add_argument("--_workers", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_run", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_accumulate", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.result_ = args._result
    if args._plan is not None:
        args.layers_, args.hosts_ = args._plan
        args.shapes_ = args._shapes
        _plan_worker(args)
        return 0
    if args._run is not None:
        args.stages_, args.accumulate_ = args._run, args._accumulate
        _run_worker(args)
        return 0
    args.cmdline = ("benchmarks/pipeline.py " + " ".join(
        sys.argv[1:] if argv is None else argv)).strip()
    res = results(args, run)
    text = section(res)
    write_result(text, args.out)
    _progress(f"wrote {args.out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
