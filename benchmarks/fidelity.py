"""autopar cost-model fidelity: does the predicted step time rank plans the way they run?

Run from the repository root; it rewrites benchmarks/results/fidelity.md:

    .venv/bin/python benchmarks/fidelity.py                     # both models, ~10 min, 2 cores
    .venv/bin/python benchmarks/fidelity.py --models mlp --out /tmp/f.md
    .venv/bin/python benchmarks/fidelity.py --from-json /tmp/f.json   # re-render saved results
    .venv/bin/python benchmarks/fidelity.py --ab      # also the model before fusion, timed
                                                    # in the same rounds (~2x as long)
    .venv/bin/python benchmarks/fidelity.py --baseline-json old.json --baseline-label b368db5
                                                    # adds a table against an earlier run

On 8 simulated CPU devices, for a GPT and an MLP train step (`optax.adam`), it takes the
candidate plans of `CANDIDATES`: autopar's choice (the ILP on the 2 x 4 mesh), the ILP on the
other mesh shapes, data parallel, ZeRO-2, ZeRO-3, Megatron-style tensor parallelism pinned
through `sharding_rules` (`models.gpt.megatron_rules`, `models.mlp.megatron_rules`) at three
data x tensor splits, 2- and 4-stage pipelines, and random feasible plans
(`ParallelizedFunction.sample_plan`: the ILP's plan with every strategy group redrawn with
probability 1.0, 0.3 or 0.1). Every plan is made against the cluster that `autopar.profile`
measured on this mesh first (`ClusterSpec.from_profile`), so predictions use measured flop/s
and link alpha/beta. Each candidate's predicted step (`plan.predicted_step_s`) is compared
with its measured step: every candidate of a model is planned and compiled in one process, then
timed in `--steps` interleaved rounds (one step of each candidate per round, after a compile
and a warm-up step), and the median is shown; interleaving makes load that drifts on a shared
machine hit every candidate alike.

Reported per model: the Spearman rank correlation between predicted and measured step times
(goal >= 0.9) and the regret of autopar's choice, its measured time over the best measured
candidate's (goal <= 1.10). Every model runs in its own child process; progress goes to stderr.
Nothing is invented: a candidate that failed or timed out says so and is left out of the
statistics.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

from common import (
    NUM_DEVICES,
    Saver,
    cpu_model,
    load_avg,
    md_row,
    progress,
    result_path,
    run_child,
    setup_worker,
    source_revision,
    utc_now,
    write_result,
)

KEY = "fidelity"
GPT_CFG = dict(vocab_size=2048, seq_len=64, num_layers=4, hidden=256, num_heads=4)
GPT_BATCH = 16
MLP_LAYERS, MLP_HIDDEN, MLP_BATCH = 4, 1024, 512
MICROBATCHES = 4
AUTOPAR = "autopar (ILP, 2x4)"

# name -> (kind, mesh shape, argument); see `_method`.
CANDIDATES = {
    AUTOPAR: ("shard", (2, 4), None),
    "ILP on 1x8": ("shard", (1, 8), None),
    "ILP on 8x1": ("shard", (8, 1), None),
    "data parallel": ("data", (2, 4), None),
    "ZeRO-2": ("zero2", (2, 4), None),
    "ZeRO-3": ("zero3", (2, 4), None),
    "Megatron d2 x t4": ("megatron", (2, 4), None),
    "Megatron t8": ("megatron", (1, 8), None),
    "Megatron d4 x t2": ("megatron", (4, 2), None),
    "pipeline 2 stages": ("pipeline", (2, 4), 2),
    "pipeline 4 stages": ("pipeline", (2, 4), 4),
    "random (all groups), seed 0": ("random", (2, 4), (0, 1.0)),
    "random (all groups), seed 1": ("random", (2, 4), (1, 1.0)),
    "random (30% of groups), seed 2": ("random", (2, 4), (2, 0.3)),
    "random (10% of groups), seed 3": ("random", (2, 4), (3, 0.1)),
}


def _progress(msg: str) -> None:
    progress("fidelity", msg)


# ---------------------------------------------------------------------------------------------
# Workers (each in its own process).
# ---------------------------------------------------------------------------------------------

def _profile_worker(args) -> None:
    """Profile the 8-device mesh once; later workers build their cluster from the file."""
    setup_worker(NUM_DEVICES)
    import jax

    import autopar
    out = Saver(args.result_)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    t0 = time.perf_counter()
    prof = autopar.profile(mesh, refresh=True, use_cache=False)
    out.data["wall_s"] = time.perf_counter() - t0
    prof.save(args.profile)
    out.data["matmul_flops_per_s"] = prof.matmul_flops_per_s
    out.data["memory_bytes_per_s"] = prof.memory_bytes_per_s
    out.data["axes"] = [{"name": a.name, "size": a.size, "alpha_s": a.alpha_s,
                         "beta_s_per_byte": a.beta_s_per_byte} for a in prof.axes]
    out.save()


def _model(name: str):
    """(train_step, initial state, batch, sharding rules for Megatron)."""
    import jax
    import optax
    from flax.training import train_state

    import autopar
    key = jax.random.key(0)
    if name == "gpt":
        from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch, megatron_rules
        cfg = GPTConfig(**GPT_CFG)
        net, batch = GPT(cfg), make_gpt_batch(key, GPT_BATCH, cfg)
        x, loss = batch["tokens"], lambda out, b: gpt_loss(out, b["tokens"])
        rules = megatron_rules()
        inputs = lambda b: b["tokens"]
    else:
        from autopar.models.mlp import MLP, make_mlp_batch, megatron_rules, mse_loss
        net = MLP(num_layers=MLP_LAYERS, hidden=MLP_HIDDEN)
        batch = make_mlp_batch(key, MLP_BATCH, MLP_HIDDEN, MLP_HIDDEN)
        x, loss = batch["x"], lambda out, b: mse_loss(out, b["y"])
        rules = megatron_rules(MLP_LAYERS)
        inputs = lambda b: b["x"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=net.init(key, x),
                                          tx=optax.adam(1e-3))

    def step(state, batch):
        def loss_fn(p):
            return loss(state.apply_fn(p, inputs(batch)), batch)
        value, grads = autopar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), value
    return step, state, batch, rules


def _method(kind: str, arg, rules):
    import autopar
    if kind == "pipeline":
        return autopar.PipeshardParallel(
            num_microbatches=MICROBATCHES, layer_option=autopar.AutoLayerOption(num_layers=4),
            stage_option=autopar.UniformStageOption(num_stages=arg))
    return {"shard": autopar.ShardParallel(), "random": autopar.ShardParallel(),
            "data": autopar.DataParallel(), "zero2": autopar.Zero2Parallel(),
            "zero3": autopar.Zero3Parallel(),
            "megatron": autopar.ShardParallel(sharding_rules=rules)}[kind]


def _model_worker(args) -> None:
    """Plan and compile every candidate of one model, then time them in interleaved rounds
    (one step of each per round), so that load drifting on a shared machine hits all of them
    alike."""
    setup_worker(NUM_DEVICES)
    import jax

    import autopar
    from autopar.cost.profiler import DeviceProfile
    out = Saver(args.result_)
    step, state, batch, rules = _model(args.model)
    profile = DeviceProfile.load(args.profile)
    variants = [("cases", autopar.ClusterSpec.from_profile(profile))]
    if args.ab:    # the model before fusion: unfused roofline, the preset's memory bandwidth
        from autopar.cost.cluster import FusionStyle
        old = autopar.ClusterSpec.from_profile(dataclasses.replace(profile,
                                                                   memory_bytes_per_s=0.0))
        variants.append(("baseline_cases", old.with_(fusion_style=FusionStyle.UNFUSED)))
    ready = {}
    for key, cluster in variants:
        cases = out.data.setdefault(key, [])
        for name in args.names:
            r = {"model": args.model, "case": name}
            cases.append(r)
            par = _prepare(r, step, state, batch, rules, cluster)
            if par is not None:
                ready[key, name] = (par, r)
            out.save()
            _progress(f"{args.model} / {name}{' (baseline)' if key != 'cases' else ''}: " + (
                r.get("error") or f"predicted {r['predicted_step_s'] * 1e3:.2f} ms, ready"))
    for rnd in range(args.steps):
        for par, r in ready.values():
            t0 = time.perf_counter()
            state_out, loss = par(state, batch)
            jax.block_until_ready((state_out, loss))
            r.setdefault("steps_s", []).append(time.perf_counter() - t0)
            r["loss"] = float(loss)
            del state_out
        for _, r in ready.values():
            r["measured_step_s"] = statistics.median(r["steps_s"])
        out.save()
        _progress(f"{args.model}: round {rnd + 1} of {args.steps} timed")


def _prepare(r: dict, step, state, batch, rules, cluster):
    """Plan candidate `r["case"]` against `cluster`, compile it and run one warm step;
    fills `r` and returns the function to time (None, with `r["error"]`, if it failed)."""
    import jax

    import autopar
    kind, shape, arg = CANDIDATES[r["case"]]
    r.update(kind=kind, mesh=list(shape))
    try:
        mesh = jax.make_mesh(shape, ("data", "model"))
        par = autopar.parallelize(step, mesh=mesh, method=_method(kind, arg, rules),
                                  batch_argnums=(1,), cluster=cluster)
        t0 = time.perf_counter()
        if kind == "random":
            plan = par.sample_plan(state, batch, seed=arg[0], fraction=arg[1])
            par = autopar.parallelize(step, mesh=mesh, plan=plan, batch_argnums=(1,),
                                      cluster=cluster)
            r["sampled"] = plan.ilp.get("message", "")
        else:
            plan = par.get_plan(state, batch)
        r["plan_s"] = time.perf_counter() - t0
        r["predicted_step_s"] = plan.predicted_step_s
        r["peak_memory_bytes"] = plan.peak_memory_bytes
        t0 = time.perf_counter()
        for _ in range(2):                              # compile, then one warm step
            jax.block_until_ready(par(state, batch))
        r["warmup_s"] = time.perf_counter() - t0
        return par
    except Exception as e:       # reported in the table, left out of the statistics
        r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return None


# ---------------------------------------------------------------------------------------------
# Statistics and the report.
# ---------------------------------------------------------------------------------------------

def ranks(values) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x, y) -> float | None:
    """Spearman's rank correlation (Pearson's on the ranks); None for fewer than 3 points."""
    if len(x) < 3:
        return None
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def summary(cases: list[dict]) -> dict:
    """Spearman and regret over the candidates that measured."""
    ok = [c for c in cases if c.get("measured_step_s") is not None]
    pred = [c["predicted_step_s"] for c in ok]
    meas = [c["measured_step_s"] for c in ok]
    ours = next((c for c in ok if c["case"] == AUTOPAR), None)
    best = min(ok, key=lambda c: c["measured_step_s"]) if ok else None
    single = [c for c in ok if c["kind"] != "pipeline"]
    ratios = sorted(c["predicted_step_s"] / c["measured_step_s"] for c in ok)
    return {
        "ratio_min": ratios[0] if ratios else None, "ratio_max": ratios[-1] if ratios else None,
        "ratio_median": statistics.median(ratios) if ratios else None,
        "n": len(ok), "spearman": spearman(pred, meas),
        "spearman_single_mesh": spearman([c["predicted_step_s"] for c in single],
                                         [c["measured_step_s"] for c in single]),
        "n_single_mesh": len(single),
        "regret": ours["measured_step_s"] / best["measured_step_s"] if ours and best else None,
        "best": best["case"] if best else None,
        "predicted_best": min(ok, key=lambda c: c["predicted_step_s"])["case"] if ok else None,
    }


def _f(x, fmt="{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def comparison(res: dict, base: dict, label: str, same_session: bool = False) -> list[str]:
    """Markdown lines comparing `res` with a `base` run (e.g. an earlier revision), or with
    the baseline model's plans timed in the same rounds (`same_session`)."""
    intro = (f"Against {label}:" if same_session else
             f"Against the run of {label} ({base['date']} UTC, load average "
             f"{base.get('load_start')} at its start), same script and candidates:")
    out = [intro, "",
           md_row(["model", "Spearman", "single-mesh Spearman", "regret",
                   "pred./meas. median (range)"]),
           md_row(["---", "---", "---", "---", "---"])]
    pair = "{} -> **{}**"
    for model, cases in res["models"].items():
        if model not in base.get("models", {}):
            continue
        a, b = summary(base["models"][model]), summary(cases)
        ratio = lambda s: (f"{_f(s['ratio_median'], '{:.2f}')} ({_f(s['ratio_min'], '{:.2f}')}"
                           f"-{_f(s['ratio_max'], '{:.2f}')})")
        out.append(md_row([model.upper(), pair.format(_f(a["spearman"]), _f(b["spearman"])),
                           pair.format(_f(a["spearman_single_mesh"]),
                                       _f(b["spearman_single_mesh"])),
                           pair.format(_f(a["regret"]), _f(b["regret"])),
                           pair.format(ratio(a), ratio(b))]))
    return out + [""]


def section(res: dict) -> str:
    prof = res.get("profile") or {}
    out = ["## Cost-model fidelity (predicted vs measured plans)", "",
           f"Run {res['date']} UTC on {res['machine']}, command `{res['command']}`, source "
           f"{res['revision']}; load average {res.get('load_start')} at the start, "
           f"{res.get('load_end')} at the end; {res.get('total_s', 0) / 60:.1f} min in all.", "",
           "Each candidate plan of a train step (adam) is planned against the cluster "
           "`autopar.profile` measured on this 2 x 4 mesh of 8 simulated CPU devices "
           f"(profiling took {_f(prof.get('wall_s'), '{:.1f}')} s; matmul "
           f"{_f((prof.get('matmul_flops_per_s') or {}).get('float32'), '{:.3g}')} flop/s and "
           f"fused elementwise kernels {_f(prof.get('memory_bytes_per_s'), '{:.3g}')} B/s per "
           "device, every device busy); compute is priced per node by the fusion-aware "
           "roofline (`autopar/intra_op/fusion.py`); all candidates of a "
           f"model are then timed in {res['steps']} interleaved rounds, one step each per "
           "round, after a compile and a warm-up step (median shown). GPT: "
           f"{GPT_CFG}, batch {GPT_BATCH}; MLP: {MLP_LAYERS} layers x {MLP_HIDDEN}, batch "
           f"{MLP_BATCH}. Pipelines: uniform stages, 1F1B, {MICROBATCHES} microbatches. "
           "Megatron: `sharding_rules=megatron_rules()` (column/row split, batch on `data`). "
           "Random: `sample_plan(seed, fraction)`.", ""]
    for model, cases in res["models"].items():
        s = summary(cases)
        if res.get("errors", {}).get(model):
            out += [f"{model}: the run stopped early: {res['errors'][model]}.", ""]
        out += [f"### {model.upper()}", "",
                md_row(["candidate", "mesh", "predicted ms", "measured ms", "pred./meas.",
                        "rank pred.", "rank meas.", "plan s", "note"]),
                md_row(["---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---"])]
        ok = [c for c in cases if c.get("measured_step_s") is not None]
        rp = dict(zip((c["case"] for c in ok), ranks([c["predicted_step_s"] for c in ok])))
        rm = dict(zip((c["case"] for c in ok), ranks([c["measured_step_s"] for c in ok])))
        for c in cases:
            note = c.get("error") or c.get("sampled", "")
            out.append(md_row([c["case"], "x".join(map(str, c.get("mesh", []))),
                               _f(c.get("predicted_step_s"), "{:.2f}") if c.get(
                                   "predicted_step_s") is None else
                               f"{c['predicted_step_s'] * 1e3:.2f}",
                               "–" if c.get("measured_step_s") is None else
                               f"{c['measured_step_s'] * 1e3:.1f}",
                               "–" if c.get("measured_step_s") is None else
                               f"{c['predicted_step_s'] / c['measured_step_s']:.2f}",
                               _f(rp.get(c["case"]), "{:g}"), _f(rm.get(c["case"]), "{:g}"),
                               _f(c.get("plan_s"), "{:.1f}"), note]))
        rho, regret = s["spearman"], s["regret"]
        within = s["ratio_min"] is not None and 1 / 1.3 <= s["ratio_min"] <= s["ratio_max"] <= 1.3
        out += ["", f"- Spearman rank correlation over {s['n']} candidates: **{_f(rho)}** "
                f"(goal >= 0.9: {'met' if rho is not None and rho >= 0.9 else 'missed'}); "
                f"single-mesh candidates only ({s['n_single_mesh']}): "
                f"{_f(s['spearman_single_mesh'])}.",
                f"- Regret of autopar's choice: measured {AUTOPAR} / best measured "
                f"({s['best']}) = **{_f(regret)}** (goal <= 1.10: "
                f"{'met' if regret is not None and regret <= 1.10 else 'missed'}). The "
                f"model's own favourite was {s['predicted_best']}.",
                f"- Predicted / measured step: median **{_f(s['ratio_median'], '{:.2f}')}**, "
                f"range {_f(s['ratio_min'], '{:.2f}')} to {_f(s['ratio_max'], '{:.2f}')} (goal: "
                f"within 1.3x, i.e. 0.77 to 1.3: {'met' if within else 'missed'}).", ""]
    if res.get("baseline_models"):
        out += comparison(res, {"models": res["baseline_models"]}, "the model before fusion "
                          "(every operand and result of every node, the preset's memory "
                          "bandwidth), its plans timed in the same rounds (`--ab`)",
                          same_session=True)
    if res.get("baseline"):
        out += comparison(res, res["baseline"], res.get("baseline_label", "a baseline"))
    if res.get("notes"):
        out += [res["notes"].strip(), ""]
    out += ["Absolute times on simulated CPU devices are noisy, and the 8 devices share this "
            "machine's cores, which pipelines (stages meant to run side by side) suffer from "
            "most; the single-mesh correlation is shown for that reason."]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------

def run(args) -> dict:
    res = {"date": utc_now(), "machine": f"{cpu_model()}, {os.cpu_count()} cores",
           "command": args.cmdline, "revision": source_revision(), "steps": args.steps,
           "load_start": load_avg(), "models": {}}
    t_all = time.perf_counter()
    fd, prof_path = tempfile.mkstemp(prefix="autopar-fidelity-profile-", suffix=".json")
    os.close(fd)
    script = os.path.abspath(__file__)
    _progress("profiling the 2 x 4 CPU mesh ...")
    prof, err, _ = run_child(script, ["--_profile", "--profile", prof_path],
                             "fidelity-profile-", args.case_timeout_s, "case time limit")
    res["profile"] = prof or {"error": err}
    if err:
        raise SystemExit(f"fidelity: profiling failed: {err}")
    names = [c for c in CANDIDATES if not args.only or c in args.only]
    for model in args.models:
        _progress(f"{model}: {len(names)} candidates ...")
        r, err, wall = run_child(script, ["--_model_worker", "--model", model, "--profile",
                                          prof_path, "--steps", str(args.steps),
                                          *(["--ab"] if args.ab else []), "--names", *names],
                                 "fidelity-model-", args.model_timeout_s, "model time limit")
        cases = (r or {}).get("cases", [])
        if err:          # what it measured before it stopped still counts; say what stopped
            res.setdefault("errors", {})[model] = err
        res["models"][model] = cases
        if args.ab:
            res.setdefault("baseline_models", {})[model] = (r or {}).get("baseline_cases", [])
        res.setdefault("wall_s", {})[model] = wall
    os.unlink(prof_path)
    res["load_end"] = load_avg()
    res["total_s"] = time.perf_counter() - t_all
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt", "mlp"], choices=["gpt", "mlp"])
    p.add_argument("--only", nargs="+", default=None, metavar="CANDIDATE",
                   help="a subset of: " + ", ".join(CANDIDATES).replace("%", "%%"))
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--case-timeout-s", type=float, default=120.0, help="for profiling")
    p.add_argument("--model-timeout-s", type=float, default=900.0)
    p.add_argument("--out", default=result_path(KEY),
                   help="the Markdown file to write (default: benchmarks/results/fidelity.md)")
    p.add_argument("--save-json", default=None)
    p.add_argument("--from-json", default=None)
    p.add_argument("--baseline-json", default=None,
                   help="a --save-json file of an earlier run to compare with")
    p.add_argument("--baseline-label", default="the baseline")
    p.add_argument("--notes-file", default=None,
                   help="markdown appended to the report (e.g. other runs and their load)")
    p.add_argument("--ab", action="store_true",
                   help="also plan every candidate with the model before fusion (unfused "
                        "roofline, the preset's memory bandwidth) and time both in the same "
                        "rounds")
    p.add_argument("--_profile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_model_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--names", nargs="+", default=[], help=argparse.SUPPRESS)
    p.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    p.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", dest="result_", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._profile:
        _profile_worker(args)
        return 0
    if args._model_worker:
        _model_worker(args)
        return 0
    args.cmdline = ("benchmarks/fidelity.py (as `make bench-paper` runs it)"
                    if sys.argv[1:] == [] else "benchmarks/fidelity.py " + " ".join(sys.argv[1:]))
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
    else:
        res = run(args)
        if args.save_json:
            with open(args.save_json, "w") as f:
                json.dump(res, f, indent=1)
    if args.notes_file:
        with open(args.notes_file) as f:
            res["notes"] = f.read()
    if args.baseline_json:
        with open(args.baseline_json) as f:
            res["baseline"] = json.load(f)
        res["baseline_label"] = args.baseline_label
    text = section(res)
    write_result(text, args.out)
    _progress(f"wrote {args.out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
