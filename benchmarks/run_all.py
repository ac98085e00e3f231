"""autopar benchmark: planning cost, compile time, and predicted vs measured step time.

Run from the repository root (`make bench` runs exactly this with no flags):

    .venv/bin/python benchmarks/run_all.py               # 2, 6, 12, 24 layers, every report
    .venv/bin/python benchmarks/run_all.py --layers 2 6         # a subset
    .venv/bin/python benchmarks/run_all.py --layers 2 --no-measure --out-dir /tmp/b  # plan only
    .venv/bin/python benchmarks/run_all.py --only pipeline      # only pipeline.md
    .venv/bin/python benchmarks/run_all.py --only shard         # only shard_parallel.md

Each benchmark writes its report to benchmarks/results/<name>.md (`--out-dir`: elsewhere);
this script's own is shard_parallel.md. BENCHMARKS.md, the index of those files with one
headline each, is kept by hand.

Workload: a flax linen GPT (hidden 768, 12 heads, vocab 8192, seq_len 128, global batch 8),
`TrainState` with `optax.adamw`, on 8 simulated CPU devices viewed as a 2 x 4 ("data", "model")
mesh. For each size the step is planned on a fresh `autopar.parallelize(...)` twice: with the
full ILP (`ShardParallel`, the default) and with `DataParallel()`; both are compiled, and both
are run side by side in the same benchmark run.

Each (size, method) runs in its own child process, so its memory is returned before the next
starts (the 8 simulated devices share host RAM), and a child that is killed (time limit, out
of memory) still leaves what it measured before (it saves its results after every phase).
Progress goes to stderr.

After the sizes (unless `--only shard`) it runs the other `make bench` benchmarks, each
writing its own report: `benchmarks/pipeline.py` (pipeline.md: planning time for 8 and 64 GPUs,
and the measured pipeline step against its ideal schedule time; its options, `--plan-layers`,
`--stages`, ... see `--help`, are accepted here too; `--only pipeline` runs just it), then
`multihost.py` (multihost.md: a cached plan lookup against a fresh search; the step time of 2
processes x 4 devices next to 1 process x 8), `methods.py` (methods.md: each method's compiled
collectives next to its plan's), `accumulation.py` (accumulation.md: M microbatches against
the whole batch, autopar next to a hand-written jax.jit accumulator), `loops.py` (loops.md: a
scanned GPT next to its unrolled twin), `shared_copies.py` (shared_copies.md: the plain ILP's
plans next to the shared ILP's),
`real_world.py` (real_world.md: memory per device of Flax/JAX-doc-style steps),
`budget_plan.py` (budget_plan.md: planning under a binding memory budget),
`memory.py` (memory.md: memory fidelity), `runner_ups.py` (runner_ups.md: what pricing the
runner-ups costs), `schedules.py` (schedules.md: 1F1B, ZB-H1, ZB-H2 and AUTO on the same
stages, predicted and measured) and `schedule_search.py` (schedule_search.md: AUTO's joint
search against 1F1B alone, planned for a V100 host), run last. The other reports (`make
bench-paper`'s fidelity.md and paper.md, gpu.md from a GPU machine, ...) are left as they are.

Nothing here is invented: a number that was not measured is written as "not measured" with
the reason.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import accumulation as accumulation_bench  # benchmarks/accumulation.py (this script's folder)
import budget_plan as budget_plan_bench  # benchmarks/budget_plan.py (this script's folder)
import loops as loops_bench  # benchmarks/loops.py (this script's folder)
import memory as memory_bench  # benchmarks/memory.py (this script's folder)
import methods as methods_bench  # benchmarks/methods.py (this script's folder)
import multihost as multihost_bench  # benchmarks/multihost.py (this script's folder)
import pipeline as pipeline_bench  # benchmarks/pipeline.py (this script's folder)
import pipeline_report
import real_world as real_world_bench  # benchmarks/real_world.py (this script's folder)
import runner_ups as runner_ups_bench  # benchmarks/runner_ups.py (this script's folder)
import schedule_search as schedule_search_bench  # benchmarks/schedule_search.py (this folder)
import schedules as schedules_bench  # benchmarks/schedules.py (this script's folder)
import shared_copies as shared_copies_bench  # benchmarks/shared_copies.py (this folder)
from common import (
    AXIS_NAMES,
    MESH_SHAPE,
    NUM_DEVICES,
    RESULTS_DIR,
    Saver,
    fmt,
    gpt_state_fn,
    gpt_train_step,
    jax_info,
    md_row,
    mem_available_bytes,
    mem_total_bytes,
    ms,
    progress,
    revision_text,
    run_child,
    setup_worker,
    source_revision,
    utc_now,
    write_result,
)

DEFAULT_LAYERS = (2, 6, 12, 24)
HIDDEN, HEADS, VOCAB, SEQ_LEN, BATCH = 768, 12, 8192, 128, 8
# Result key -> method; each (size, method) runs in its own process, SP first, then DP.
METHODS = {"shard": lambda ap: ap.ShardParallel(), "data": lambda ap: ap.DataParallel()}


def _progress(msg: str) -> None:
    progress("bench", msg)


# ---------------------------------------------------------------------------------------------
# Worker: one model size, in its own process.
# ---------------------------------------------------------------------------------------------

def _worker(args) -> None:
    setup_worker(NUM_DEVICES)
    import jax
    import optax

    import autopar
    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, gpt_param_count, make_gpt_batch

    layers = args.worker
    saver = Saver(args.result)
    save, result = saver.save, saver.data
    result["layers"] = layers

    devices = jax.devices()
    result["jax"] = {"version": jax.__version__, "platform": devices[0].platform,
                     "device_kind": devices[0].device_kind, "device_count": len(devices)}
    if len(devices) < NUM_DEVICES:
        result["error"] = f"need {NUM_DEVICES} devices, jax sees {len(devices)}"
        save()
        return

    cfg = GPTConfig(vocab_size=VOCAB, seq_len=args.seq_len, num_layers=layers, hidden=HIDDEN,
                    num_heads=HEADS)
    result["params"] = gpt_param_count(cfg)
    model = GPT(cfg)
    train_step = gpt_train_step(gpt_loss, jax.value_and_grad)

    key = jax.random.key(0)
    batch = make_gpt_batch(jax.random.fold_in(key, 1), BATCH, cfg)
    # A jitted init: fresh device buffers on device 0, never aliasing host memory.
    make_state = jax.jit(gpt_state_fn(model, optax.adamw(1e-4, weight_decay=0.01), cfg.seq_len))
    _progress(f"L={layers}: creating state ({result['params'] / 1e6:.1f} M parameters)")
    state = make_state(key)
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state) if hasattr(x, "nbytes"))
    result["state_bytes"] = state_bytes
    mesh = jax.make_mesh(MESH_SHAPE, AXIS_NAMES)

    name = args.method
    method = METHODS[name](autopar)
    r = result.setdefault(name, {})
    # The state is donated, as in a real training loop: on simulated CPU devices all 8
    # "devices" share the host RAM, and without donation the input and output states of a
    # replicated (data-parallel) step would both be live.
    step = autopar.parallelize(train_step, mesh=mesh, method=method, batch_argnums=(1,),
                               donate_argnums=(0,))
    _progress(f"L={layers} {name}: planning ...")
    t0 = time.perf_counter()
    plan = step.get_plan(state, batch)
    r["plan_wall_s"] = time.perf_counter() - t0
    r["timings_s"] = dict(plan.timings_s)
    r["ilp"] = {k: plan.ilp.get(k) for k in (
        "num_groups", "num_edges", "num_memory_points", "num_variables", "num_constraints",
        "build_time_s", "solve_time_s", "status", "backend", "message")} if plan.ilp else {}
    r["predicted_step_s"] = plan.predicted_step_s
    r["predicted_compute_s"] = plan.predicted_compute_s
    r["predicted_comm_s"] = plan.predicted_comm_s
    r["predicted_reshard_s"] = plan.predicted_reshard_s
    r["peak_memory_bytes"] = plan.peak_memory_bytes
    # a plan whose memory binds is compiled while planning (memory_check): get_compiled is then
    # immediate and the compile time is inside plan_wall_s
    r["compiled_in_plan"] = "compiled_bytes" in plan.measured
    save()
    _progress(f"L={layers} {name}: planned in {r['plan_wall_s']:.2f} s "
              f"(ILP {r['ilp'].get('num_variables')} variables, status "
              f"{r['ilp'].get('status')}); predicted step {plan.predicted_step_s * 1e3:.2f} ms")

    if args.no_measure:
        result["measure_skipped"] = "--no-measure"
        save()
        return

    _progress(f"L={layers} {name}: compiling ...")
    t0 = time.perf_counter()
    step.get_compiled(state, batch)
    r["compile_s"] = time.perf_counter() - t0
    save()
    _progress(f"L={layers} {name}: compiled in {r['compile_s']:.2f} s")

    del state  # the timed steps start from a fresh state (the step donates it)
    # All 8 simulated devices share host RAM: estimate the step's footprint from the
    # plan's per-device peak (and the unsharded state we start from) and skip rather than
    # swap or get killed.
    need = NUM_DEVICES * r["peak_memory_bytes"] + state_bytes
    avail = mem_available_bytes()
    if avail and need > 0.85 * avail:
        r["not_measured"] = (f"needs about {need / 2**30:.1f} GiB of host RAM ({NUM_DEVICES} "
                             f"simulated devices x {r['peak_memory_bytes'] / 2**30:.2f} GiB "
                             f"predicted peak + the initial state); "
                             f"{avail / 2**30:.1f} GiB available")
        save()
        _progress(f"L={layers} {name}: not measured: {r['not_measured']}")
        return
    _progress(f"L={layers} {name}: first step ...")
    st = make_state(key)
    t0 = time.perf_counter()
    st, loss = step(st, batch)
    jax.block_until_ready((st, loss))
    first = time.perf_counter() - t0
    r["first_step_s"] = first
    r["first_loss"] = float(loss)
    save()
    _progress(f"L={layers} {name}: first step {first:.2f} s (loss {float(loss):.4f})")
    if first > args.first_step_budget_s:
        r["not_measured"] = (f"first step took {first:.1f} s "
                             f"(> budget {args.first_step_budget_s:.0f} s)")
        del st
        save()
        return
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        st, loss = step(st, batch)
        jax.block_until_ready((st, loss))
        times.append(time.perf_counter() - t0)
        _progress(f"L={layers} {name}: step {i + 1}/{args.steps} {times[-1]:.3f} s")
        if len(times) >= 3 and sum(times) > args.measure_budget_s:
            _progress(f"L={layers} {name}: stopping after {len(times)} steps "
                      f"(--measure-budget-s {args.measure_budget_s:.0f})")
            break
    r["step_times_s"] = times
    r["measured_step_s"] = statistics.median(times)
    r["last_loss"] = float(loss)
    del st, loss
    save()


# ---------------------------------------------------------------------------------------------
# Driver: one child per (size, method), then benchmarks/results/shard_parallel.md.
# ---------------------------------------------------------------------------------------------

def _run_worker(layers: int, method: str, args) -> dict:
    argv = ["--_worker", str(layers), "--_method", method,
            "--seq-len", str(args.seq_len), "--steps", str(args.steps),
            "--first-step-budget-s", str(args.first_step_budget_s),
            "--measure-budget-s", str(args.measure_budget_s)]
    if args.no_measure:
        argv.append("--no-measure")
    _progress(f"L={layers} {method}: starting worker")
    result, outcome, wall_s = run_child(os.path.abspath(__file__), argv,
                                        f"autopar_bench_L{layers}_{method}_",
                                        args.size_timeout_s, "per-worker limit")
    result = result or {"layers": layers}
    if outcome:
        result.setdefault(method, {})["incomplete"] = outcome
    _progress(f"L={layers} {method}: worker done in {wall_s:.1f} s"
              + (f" ({outcome})" if outcome else ""))
    return result


def _run_size(layers: int, args) -> dict:
    merged: dict = {"layers": layers}
    t0 = time.perf_counter()
    for method in METHODS:
        part = _run_worker(layers, method, args)
        for k, v in part.items():
            if k == method:
                merged[k] = v
            elif k not in METHODS:
                merged.setdefault(k, v)
    merged["wall_s"] = time.perf_counter() - t0
    return merged


def _compile_cell(m: dict, r: dict) -> str:
    if r.get("measure_skipped"):
        return "not run"
    if m.get("compiled_in_plan"):
        return "in plan s (memory check)"
    return fmt(m.get("compile_s"))


def _sp_dp(r: dict) -> tuple[dict, dict]:
    """The ShardParallel and the DataParallel results of one size ({} where missing)."""
    return r.get("shard", {}), r.get("data", {})


def _machine(results) -> list[str]:
    jx = jax_info(results)
    ram = mem_total_bytes()
    lines = [f"- platform: `{platform.platform()}` ({platform.machine()}, "
             f"{platform.processor() or 'processor n/a'}), Python {platform.python_version()}",
             f"- CPU cores (`os.cpu_count()`): {os.cpu_count()}; total RAM: "
             + (f"{ram / 2**30:.1f} GiB" if ram else "unknown")]
    if jx:
        lines.append(f"- jax {jx['version']}: {jx['device_count']} x `{jx['platform']}` devices "
                     f"(device kind `{jx['device_kind']}`), simulated with "
                     f"`XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES}`")
    return lines


def _devices_text(results) -> str:
    jx = jax_info(results)
    return f"`{jx['platform']}` devices" if jx else "the devices"


def _linearity(rows) -> list[str]:
    keys = (("num_groups", "strategy groups"), ("num_variables", "variables"),
            ("num_constraints", "constraints"))
    pts = sorted((r["layers"], [r["shard"]["ilp"].get(k) for k, _ in keys]) for r in rows
                 if r.get("shard", {}).get("ilp", {}).get("num_variables") is not None)
    if len(pts) < 2:
        return ["- **ILP size grows at most linearly with layers**: not checked (fewer than two "
                "sizes were planned)."]
    lines, verdicts = [], []
    for j, (_, label) in enumerate(keys):
        vals = [(n, v[j]) for n, v in pts]
        n0, v0 = vals[0]
        # At most linear: one more layer never costs more than the largest earlier marginal
        # cost, nor than the smallest model's average cost per layer (10% tolerance).
        ceiling = v0 / n0
        incs, ok = [], True
        for (na, va), (nb, vb) in zip(vals, vals[1:]):
            d = (vb - va) / (nb - na)
            ok &= d <= 1.1 * ceiling + 1
            ceiling = max(ceiling, d)
            incs.append(f"{na}->{nb}: {d:+,.0f}/layer")
        verdicts.append(ok)
        lines.append(f"  - {label}: " + ", ".join(f"{n} layers {v:,} ({v / n:,.0f}/layer)"
                                                  for n, v in vals)
                     + "; marginal " + ", ".join(incs) + ("" if ok else "  <- grows faster"))
    verdict = "holds" if all(verdicts) else "does NOT hold"
    return [f"- **ILP size grows at most linearly with layers**: {verdict} for the sizes planned "
            f"(criterion: the marginal size of one more layer, between consecutive sizes, never "
            f"exceeds 1.1 x the largest earlier marginal or the smallest model's size per layer; "
            f"`variables` and `constraints` are those of the model the solver saw):"] + lines


def _planning_claim(rows) -> str:
    r12 = next((r for r in rows if r["layers"] == 12), None)
    if r12 is None:
        return ("- **Planning the 12-layer GPT takes under 20 s**: not checked (12 layers was "
                "not in this run).")
    t = r12.get("shard", {}).get("plan_wall_s")
    if t is None:
        why = (r12.get("shard", {}).get("incomplete") or r12.get("error")
               or "planning did not finish")
        return f"- **Planning the 12-layer GPT takes under 20 s**: not checked ({why})."
    verdict = "holds" if t < 20 else "does NOT hold"
    tm = r12["shard"].get("timings_s", {})
    ilp = r12["shard"].get("ilp", {})
    return (f"- **Planning the 12-layer GPT takes under 20 s**: {verdict}: "
            f"`get_plan` took {t:.1f} s (trace {fmt(tm.get('trace'))} s, intra-op "
            f"{fmt(tm.get('intra_op'))} s of which ILP build {fmt(ilp.get('build_time_s'))} s "
            f"and solve {fmt(ilp.get('solve_time_s'))} s).")


def _write(results, args, started_utc, total_s) -> str:
    """The report of this script (shard_parallel.md)."""
    rev = revision_text(args.revision, source_revision())
    out = ["## ShardParallel vs DataParallel: planning, compilation, step time", "",
           f"Generated by `{args.cmdline}` (`make bench` runs `.venv/bin/python "
           f"benchmarks/run_all.py` with no flags) on {started_utc} UTC; the whole run took "
           f"{total_s / 60:.1f} min.", "",
           f"Source: `{rev}`.", "",
           "### Machine", ""] + _machine(results) + [
           "", "### Workload", "",
           f"flax linen GPT (`autopar/models/gpt.py`): hidden {HIDDEN}, {HEADS} heads, "
           f"vocab {VOCAB}, seq_len {args.seq_len}, global batch {BATCH}; `TrainState` with "
           f"`optax.adamw`; "
           f"mesh {MESH_SHAPE[0]} x {MESH_SHAPE[1]} {AXIS_NAMES}. The step is "
           f"`autopar.parallelize(train_step, mesh=mesh, batch_argnums=(1,), donate_argnums=(0,))`"
           f" with the default method (`ShardParallel`, the full ILP) and with "
           f"`method=autopar.DataParallel()`, each on a fresh `ParallelizedFunction`.", ""]
    if args.seq_len != SEQ_LEN:
        out += [f"seq_len was lowered from {SEQ_LEN} to {args.seq_len} for this run.", ""]
    rows = sorted(results, key=lambda r: r["layers"])

    out += ["### Planning and compilation (ShardParallel)", "",
            "`plan s` is the wall time of `step.get_plan(state, batch)` on a fresh "
            "`ParallelizedFunction` (trace + ILP build + solve + plan assembly); `trace` and "
            "`intra-op` come from `plan.timings_s`, ILP columns from `plan.ilp`; `plan s` includes "
            "the runner-ups (see runner_ups.md, \"Why this plan\"). `compile s` is the wall "
            "time of `step.get_compiled(state, batch)` (XLA compile of the partitioned step); a "
            "plan whose memory binds was compiled while planning (the memory check), inside its "
            "`plan s`.", "",
            "| layers | params (M) | plan s | trace s | intra-op s | ILP build s | ILP solve s | "
            "status | groups | edges | variables | constraints | variables/layer | compile s | "
            "DataParallel plan s | DataParallel compile s |",
            "|---:|---:|---:|---:|---:|---:|---:|:--|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        sp, dp = _sp_dp(r)
        ilp, tm = sp.get("ilp", {}), sp.get("timings_s", {})
        nv = ilp.get("num_variables")
        out.append(md_row([
            str(r["layers"]), fmt(r.get("params"), 1, 1e-6), fmt(sp.get("plan_wall_s")),
            fmt(tm.get("trace")), fmt(tm.get("intra_op")), fmt(ilp.get("build_time_s")),
            fmt(ilp.get("solve_time_s")), fmt(ilp.get("status")),
            fmt(ilp.get("num_groups"), 0), fmt(ilp.get("num_edges"), 0), fmt(nv, 0),
            fmt(ilp.get("num_constraints"), 0),
            fmt(nv / r["layers"] if nv is not None else None, 0),
            _compile_cell(sp, r), fmt(dp.get("plan_wall_s")), _compile_cell(dp, r)]))

    out += ["", "### Step time: predicted vs measured, ShardParallel (SP) vs DataParallel (DP)",
            "",
            "Predicted = `plan.predicted_step_s` (autopar's cost model for "
            f"{_devices_text(results)}). "
            f"Measured = median wall time of {args.steps} steps (fewer, but at least 3, when "
            f"they add up to more than {args.measure_budget_s:.0f} s; `n` says how many) after "
            f"1 warm-up step, each "
            f"ended with `jax.block_until_ready`; both methods run in the same benchmark run, "
            f"one after the other, each in a fresh process (so each gets the whole host RAM). "
            f"A method whose first step took more than "
            f"{args.first_step_budget_s:.0f} s, or that would not fit in host RAM, is not "
            f"measured (the reason is given). Ratios below 1 mean SP is faster.", "",
            "| layers | predicted SP ms | predicted DP ms | predicted SP/DP | predicted peak "
            "GiB/device SP / DP | first step SP s | first step DP s | measured SP ms | "
            "measured DP ms | n | measured SP/DP | loss after last step SP / DP | notes |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:--|"]
    for r in rows:
        sp, dp = _sp_dp(r)
        psp, pdp = sp.get("predicted_step_s"), dp.get("predicted_step_s")
        msp, mdp = sp.get("measured_step_s"), dp.get("measured_step_s")
        notes = []
        if r.get("measure_skipped"):
            notes.append("not measured: run with --no-measure")
        for label, d in (("SP", sp), ("DP", dp)):
            if d.get("not_measured"):
                notes.append(f"{label} not measured: {d['not_measured']}")
            if d.get("incomplete"):
                notes.append(f"{label} incomplete: {d['incomplete']}")
        if r.get("error"):
            notes.append(f"error: {r['error']}")
        out.append(md_row([
            str(r["layers"]), ms(psp), ms(pdp),
            fmt(psp / pdp if psp and pdp else None, 3),
            f"{fmt(sp.get('peak_memory_bytes'), 2, 2**-30)} / "
            f"{fmt(dp.get('peak_memory_bytes'), 2, 2**-30)}",
            fmt(sp.get("first_step_s")), fmt(dp.get("first_step_s")),
            ms(msp) if msp is not None else "not measured",
            ms(mdp) if mdp is not None else "not measured",
            "/".join(str(len(d["step_times_s"])) for d in (sp, dp) if "step_times_s" in d)
            or "–",
            fmt(msp / mdp if msp and mdp else None, 3),
            f"{fmt(sp.get('last_loss'), 4)} / {fmt(dp.get('last_loss'), 4)}",
            "; ".join(notes) or "–"]))

    out += ["", "### Claims", "", *_linearity(rows), _planning_claim(rows), "",
            "### Notes", "",
            "- Absolute CPU times are noisy: the 8 \"devices\" are threads of one process "
            f"sharing {os.cpu_count()} CPU cores and one memory system, other work on the machine "
            "competes with them, and collectives are memory copies. Only the side-by-side "
            "ratios (SP vs DP in the same run) mean much; the predicted times are for the "
            "cost model's CPU device description, not for this machine's contention.",
            "- The first step includes any compilation the call path did not reuse from "
            "`get_compiled`, which is why it is reported apart from the median.",
            "- Numbers are produced by `benchmarks/run_all.py` from one run; nothing is "
            "filled in by hand."]
    unfinished = [f"{r['layers']} layers {label}: {d.get('incomplete') or r.get('error')}"
                  for r in rows for label, d in zip(("SP", "DP"), _sp_dp(r))
                  if d.get("incomplete") or r.get("error")]
    if unfinished:
        out.append("- Runs that did not finish: " + "; ".join(unfinished) + ".")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS),
                   help="GPT depths to benchmark (default: 2 6 12 24)")
    p.add_argument("--no-measure", action="store_true",
                   help="plan only: no compilation, no steps")
    p.add_argument("--out-dir", default=RESULTS_DIR,
                   help="folder of the reports, <name>.md each (default: benchmarks/results)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per method (median)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--first-step-budget-s", type=float, default=60.0,
                   help="skip timing a method whose first step takes longer than this")
    p.add_argument("--measure-budget-s", type=float, default=150.0,
                   help="stop timing a method after this many seconds of steps (min 3 steps)")
    p.add_argument("--size-timeout-s", type=float, default=3600.0,
                   help="kill a (size, method) worker after this long (what it measured is kept)")
    p.add_argument("--only", choices=("all", "shard", "pipeline"), default="all",
                   help="all (default): every report; shard: the ShardParallel/DataParallel "
                        "one only (shard_parallel.md); pipeline: only pipeline.md")
    pipeline_bench.add_arguments(p)
    p.add_argument("--_worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_method", default="shard", choices=list(METHODS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.worker = args._worker
    args.result = args._result
    args.method = args._method
    if args.worker is not None:
        _worker(args)
        return 0

    args.cmdline = "make bench" if sys.argv[1:] == [] else (
        "benchmarks/run_all.py " + " ".join(sys.argv[1:]))
    if args.no_measure:
        args.no_run = True          # plan only: the pipeline benchmark skips its measured part

    def save(key: str, text: str) -> None:
        path = os.path.join(args.out_dir, f"{key}.md")
        write_result(text, path)
        _progress(f"wrote {path}")

    if args.only == "pipeline":
        text = pipeline_report.section(pipeline_bench.run(args))
        save("pipeline", text)
        print(text)
        return 0
    started = utc_now()
    args.revision = source_revision()
    t0 = time.perf_counter()
    results = []
    for layers in args.layers:
        results.append(_run_size(layers, args))
        # Rewrite after every size, so a long run that is stopped still leaves a report.
        text = _write(results, args, started, time.perf_counter() - t0)
        save("shard_parallel", text)
    if args.only == "all":
        # The other benchmarks of `make bench`, each into its own report.
        _progress("pipeline ...")
        save("pipeline", pipeline_report.section(pipeline_bench.run(args)))
        for key, bench, what in (("multihost", multihost_bench, "multi-host and plan cache"),
                                 ("methods", methods_bench, "method promises"),
                                 ("accumulation", accumulation_bench, "gradient accumulation"),
                                 ("loops", loops_bench, "loops"),
                                 ("shared_copies", shared_copies_bench, "shared copies"),
                                 ("real_world", real_world_bench, "real-world steps"),
                                 ("budget_plan", budget_plan_bench, "planning under a budget"),
                                 ("memory", memory_bench, "memory fidelity"),
                                 ("runner_ups", runner_ups_bench, "runner-ups"),
                                 ("schedules", schedules_bench, "pipeline schedules"),
                                 ("schedule_search", schedule_search_bench,
                                  "the schedule searched with the stages")):
            _progress(f"{what} ...")
            save(key, bench.section(bench.run(), args.cmdline))
        # Once more, with the whole run's time.
        text = _write(results, args, started, time.perf_counter() - t0)
        save("shard_parallel", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
