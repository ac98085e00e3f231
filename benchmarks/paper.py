"""Alpa's evaluation (Zheng et al., OSDI 2022, weak scaling on up to 8 AWS p3.16xlarge = 64
V100 16 GB), planned by autopar on paper hardware, and the planning-time scale plot.

Run from the repository root; it rewrites benchmarks/results/paper.md and the plot beside it,
benchmarks/results/paper-scale.png:

    .venv/bin/python benchmarks/paper.py                       # the default (~15 min, 2 cores)
    make bench-paper                                           # fidelity.py, then this
    .venv/bin/python benchmarks/paper.py --gpt 350M 1.3B --no-moe --no-wrn --no-scale \\
        --out /tmp/p.md                                        # a subset, elsewhere
    .venv/bin/python benchmarks/paper.py --from-json /tmp/r.json   # re-render saved results

Part 1, per configuration of `paper_configs.py` (GPT, GShard MoE, Wide-ResNet at 1 to 64
GPUs): `autopar.plan` with abstract arguments (`jax.eval_shape` of the `TrainState`,
`jax.ShapeDtypeStruct` batch) on `ClusterSpec.preset("v100-p3.16xlarge")` (fewer than 8 GPUs:
one host with that many devices), method `PipeshardParallel(num_microbatches=M,
layer_option=AutoLayerOption(num_layers=K), stage_option=AutoStageOption(logical_shapes=
"flat"))`, M tried from the whole batch down (one, two, four examples per microbatch) while the
configuration's planning budget lasts; then the best Megatron-style manual plan under the same
cost model: a grid over data x tensor x pipeline degrees with Megatron's column/row rules
pinned (`sharding_rules`) and uniform stages (`ManualStageOption`). Part 2: planning time of a
GPT on 8 to 1024 V100s for several layer counts, with log-log slopes and the plot.

Each configuration (and each scale layer count) runs in its own child process with a time
limit; a child saves what it has after every plan, so a stopped one keeps its finished plans.
Progress goes to stderr. Every TFLOPS figure is autopar's prediction, never a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from common import (
    Saver,
    load_avg,
    progress,
    results,
    run_case,
    setup_worker,
    source_revision,
    utc_now,
)
from paper_configs import (
    ALL,
    DEFAULT,
    FAMILIES,
    PRESET,
    SCALE_AUTO_LAYERS,
    SCALE_BATCH,
    SCALE_CFG,
    SCALE_HOSTS,
    SCALE_LAYERS,
    SCALE_MICROBATCHES,
    GridPoint,
    auto_microbatches,
    cluster_shape,
    manual_stage_layout,
    megatron_grid,
)
from paper_report import DEFAULT_OUT, best_ok, write_outputs

# Manual pipelines re-planned with schedules (`_schedules`): the fastest this many.
SCHEDULED_MANUAL = 2


def _progress(msg: str) -> None:
    progress("paper", msg)


# ---------------------------------------------------------------------------------------------
# The models (call in a worker only: imports jax).
# ---------------------------------------------------------------------------------------------

def build(cfg):
    """(train_step, abstract state, abstract batch, FLOPs per step, parameter count, Megatron
    rules or None, pipeline layer count for the grid, dtype name) of a PaperConfig."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import autopar
    dims, b = cfg.dims, cfg.batch
    if cfg.family == "wrn":
        from autopar.models.wide_resnet import (
            WideResNet,
            WideResNetConfig,
            classification_loss,
            wide_resnet_flops_per_example,
            wide_resnet_param_count,
        )
        mc = WideResNetConfig(image_size=dims["image_size"], num_classes=dims["num_classes"],
                              depth=4 + 8 * dims["blocks_per_stage"], width=dims["width"],
                              base_channels=dims["base_channels"], num_stages=4)
        model, tx = WideResNet(mc), optax.sgd(0.1, momentum=0.9, nesterov=True)
        x0 = jnp.zeros((1, mc.image_size, mc.image_size, 3), jnp.float32)
        spec = {"images": jax.ShapeDtypeStruct((b, mc.image_size, mc.image_size, 3),
                                               jnp.float32),
                "labels": jax.ShapeDtypeStruct((b,), jnp.int32)}

        def loss_of(apply_fn, params, batch):
            return classification_loss(apply_fn(params, batch["images"]), batch["labels"])
        flops, params = wide_resnet_flops_per_example(mc) * b, wide_resnet_param_count(mc)
        # No Megatron rules exist for a CNN: data x pipeline only, everything replicated.
        rules, layers, dtype = ((r"^batch", ("data",)), (r".", ())), mc.num_blocks, "float32"
    else:
        common = dict(seq_len=dims["seq_len"], hidden=dims["hidden"],
                      num_layers=dims["num_layers"], num_heads=dims["num_heads"],
                      vocab_size=dims["vocab_size"], dtype=jnp.float16)
        tx = optax.adamw(1e-4)
        x0 = jnp.zeros((1, dims["seq_len"]), jnp.int32)
        spec = {"tokens": jax.ShapeDtypeStruct((b, dims["seq_len"]), jnp.int32)}
        if cfg.family == "gpt":
            from autopar.models.gpt import (
                GPT,
                GPTConfig,
                gpt_flops_per_token,
                gpt_loss,
                gpt_param_count,
                megatron_rules,
            )
            mc = GPTConfig(**common)
            model, rules = GPT(mc), megatron_rules()
            flops, params = gpt_flops_per_token(mc), gpt_param_count(mc)

            def loss_of(apply_fn, p, batch):
                return gpt_loss(apply_fn(p, batch["tokens"]), batch["tokens"])
        else:
            from autopar.models.moe import (
                MoE,
                MoEConfig,
                megatron_moe_rules,
                moe_flops_per_token,
                moe_loss,
                moe_param_count,
            )
            # Alpa's MoE: every other layer, top-2, capacity 2 S / E (capacity factor 1), MLP
            # (and expert) hidden size 8 x hidden.
            mc = MoEConfig(**common, num_experts=dims["num_experts"], expert_every=2,
                           capacity_factor=1.0, mlp_ratio=dims["mlp_ratio"])
            model, rules = MoE(mc), megatron_moe_rules()
            flops, params = moe_flops_per_token(mc), moe_param_count(mc)

            def loss_of(apply_fn, p, batch):
                logits, aux = apply_fn(p, batch["tokens"], return_aux=True)
                return moe_loss(logits, batch["tokens"], aux)
        flops *= b * dims["seq_len"]
        layers, dtype = dims["num_layers"], "float16"

    def create(key):
        return train_state.TrainState.create(apply_fn=model.apply, params=model.init(key, x0),
                                             tx=tx)

    def train_step(state, batch):
        loss, grads = autopar.value_and_grad(
            lambda p: loss_of(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads), loss
    state = jax.eval_shape(create, jax.random.key(0))
    return train_step, state, spec, float(flops), int(params), rules, layers, dtype


def make_cluster(gpus: int):
    import autopar
    hosts, dph = cluster_shape(gpus)
    cluster = autopar.ClusterSpec.preset(PRESET, num_hosts=hosts)
    return cluster if dph == cluster.devices_per_host else cluster.with_(devices_per_host=dph)


def plan_once(step, state, spec, cluster, method, flops: float, gpus: int) -> dict:
    """Plan once; the outcome as a dict (feasible or not, never raises for the plan itself)."""
    import autopar
    t0 = time.perf_counter()
    try:
        p = autopar.plan(step, state, spec, cluster=cluster, method=method,
                         mesh_shape=(cluster.num_hosts, cluster.devices_per_host))
    except autopar.InfeasiblePlanError as e:
        return {"status": "infeasible", "wall_s": time.perf_counter() - t0,
                "needed_bytes": e.needed_bytes, "budget_bytes": e.budget_bytes,
                "message": str(e)[:400]}
    except Exception as e:  # reported, not hidden: the table says what failed
        return {"status": "error", "wall_s": time.perf_counter() - t0,
                "message": f"{type(e).__name__}: {str(e)[:400]}"}
    wall = time.perf_counter() - t0
    pl = p.pipeline
    return {"status": "ok", "wall_s": wall, "timings_s": dict(p.timings_s),
            "schedule": pl.get("schedule"),
            "pipeline": {k: pl.get(k) for k in ("num_layers", "num_ilps", "num_reused",
                                                "dp_candidates", "dp_pruned", "dp_time_s",
                                                "bubble_fraction")},
            "predicted_step_s": p.predicted_step_s,
            "tflops": flops / p.predicted_step_s / gpus / 1e12,
            "peak_memory_bytes": p.peak_memory_bytes,
            "stages": [{"layers": list(s.layers), "submesh": list(s.submesh),
                        "logical": list(s.logical_mesh_shape), "remat": s.remat,
                        "zero": s.zero} for s in p.stages]}


# ---------------------------------------------------------------------------------------------
# Worker 1: one configuration (autopar's search, then the manual grid).
# ---------------------------------------------------------------------------------------------

def _case_worker(args) -> None:
    setup_worker()
    import jax

    import autopar
    cfg = ALL[args.case_]
    out = Saver(args.result_)
    r = out.data
    r.update(key=cfg.key, family=cfg.family, name=cfg.name, gpus=cfg.gpus, batch=cfg.batch,
             load_start=load_avg(), jax={"version": jax.__version__})
    step, state, spec, flops, params, rules, layers, dtype = build(cfg)
    cluster = make_cluster(cfg.gpus)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(
        (state.params, state.opt_state)))
    r.update(flops_per_step=flops, params=params, dtype=dtype, state_bytes=state_bytes,
             cluster=[cluster.num_hosts, cluster.devices_per_host])
    out.save()
    if not args.no_auto:
        a = r["auto"] = {"tries": [], "budget_s": args.auto_budget_s, "shapes": args.shapes,
                         "auto_layers": list(cfg.auto_layers), "not_tried": []}
        for k in cfg.auto_layers:        # each auto-layer count Alpa used; the best plan kept
            done = []
            for m in auto_microbatches(cfg.batch, args.auto_tries):
                # Fewer microbatches = larger ones = more activation memory: after a try that
                # does not fit, the next cannot fit either.
                if done and (done[-1]["status"] == "infeasible" or sum(
                        t["wall_s"] for t in done) >= args.auto_budget_s):
                    a["not_tried"].append({"auto_layers": k, "m": m})
                    continue
                _progress(f"{cfg.key} ({cfg.gpus} GPUs): autopar, K={k}, M={m} ...")
                method = autopar.PipeshardParallel(
                    num_microbatches=m, layer_option=autopar.AutoLayerOption(num_layers=k),
                    stage_option=autopar.AutoStageOption(logical_shapes=args.shapes))
                t = {"m": m, "auto_layers": k,
                     **plan_once(step, state, spec, cluster, method, flops, cfg.gpus)}
                done.append(t)
                a["tries"].append(t)
                out.save()
                _progress(f"{cfg.key}: autopar K={k} M={m}: {t['status']} in "
                          f"{t['wall_s']:.1f} s" + (f", {t['tflops']:.1f} TFLOPS/GPU predicted"
                                                    if "tflops" in t else ""))
    if not args.no_manual:
        grid = megatron_grid(cfg.gpus, layers, cfg.batch, tensor=cfg.family != "wrn",
                             microbatch_sizes=tuple(args.manual_mb), state_bytes=state_bytes,
                             budget_bytes=cluster.memory_bytes)
        man = r["manual"] = {"points": [], "budget_s": args.manual_budget_s,
                             "grid_layers": layers}
        spent = 0.0
        for pt in grid:
            e = {"d": pt.d, "t": pt.t, "p": pt.p, "m": pt.m}
            man["points"].append(e)
            if pt.skip or spent >= args.manual_budget_s:
                e.update(status="skipped", message=pt.skip or "manual budget spent")
                continue
            k, spans, subs, shapes = manual_stage_layout(pt)
            method = autopar.PipeshardParallel(
                num_microbatches=pt.m, layer_option=autopar.AutoLayerOption(num_layers=k),
                stage_option=autopar.ManualStageOption(layer_spans=spans, submesh_shapes=subs,
                                                       logical_shapes=shapes),
                sharding_rules=rules)
            e.update(plan_once(step, state, spec, cluster, method, flops, cfg.gpus))
            spent += e["wall_s"]
            out.save()
            _progress(f"{cfg.key}: manual d={pt.d} t={pt.t} p={pt.p} M={pt.m}: {e['status']} "
                      f"in {e['wall_s']:.1f} s"
                      + (f", {e['tflops']:.1f} TFLOPS/GPU predicted" if "tflops" in e else ""))
    if not args.no_schedules:
        _schedules(args, r, out, cfg, step, state, spec, cluster, flops, rules)
    r["load_end"] = load_avg()
    out.save()


def _schedules(args, r, out, cfg, step, state, spec, cluster, flops, rules) -> None:
    """Issue 27's columns: autopar's best (K, M) planned again with `Schedule.AUTO` (the
    schedule searched with the stages), and the best manual pipelines (p > 1; at most
    `SCHEDULED_MANUAL` of them) with schedules: their stages under `Schedule.AUTO` (1F1B,
    ZB-H1, ZB-H2 and GPipe priced on them, the fastest that fits kept) and as Megatron's
    interleaved 1F1B (2p one-layer chunks, chunk k on the devices of stage k mod p)."""
    import autopar
    s = r["schedules"] = {"manual": []}
    ab = best_ok((r.get("auto") or {}).get("tries", []))
    if ab is not None and len(ab["stages"]) > 1:
        _progress(f"{cfg.key}: autopar K={ab['auto_layers']} M={ab['m']} with Schedule.AUTO")
        method = autopar.PipeshardParallel(
            num_microbatches=ab["m"], schedule=autopar.Schedule.AUTO,
            layer_option=autopar.AutoLayerOption(num_layers=ab["auto_layers"]),
            stage_option=autopar.AutoStageOption(logical_shapes=args.shapes))
        s["auto"] = {"m": ab["m"], "auto_layers": ab["auto_layers"],
                     **plan_once(step, state, spec, cluster, method, flops, cfg.gpus)}
        out.save()
    points = sorted((e for e in (r.get("manual") or {}).get("points", [])
                     if e.get("status") == "ok" and e["p"] > 1), key=lambda e: -e["tflops"])
    for e in points[:SCHEDULED_MANUAL]:
        pt = GridPoint(d=e["d"], t=e["t"], p=e["p"], m=e["m"])
        k, spans, subs, shapes = manual_stage_layout(pt)
        chunks = manual_stage_layout(GridPoint(d=pt.d, t=pt.t, p=2 * pt.p, m=pt.m))
        tries = [(autopar.Schedule.AUTO, k, spans, subs, shapes)]
        if 2 * pt.p <= r.get("manual", {}).get("grid_layers", 0):
            tries.append((autopar.Schedule.INTERLEAVED_1F1B, *chunks))
        for schedule, k, spans, subs, shapes in tries:
            method = autopar.PipeshardParallel(
                num_microbatches=pt.m, schedule=schedule,
                layer_option=autopar.AutoLayerOption(num_layers=k),
                stage_option=autopar.ManualStageOption(layer_spans=spans, submesh_shapes=subs,
                                                       logical_shapes=shapes),
                sharding_rules=rules)
            got = {"d": pt.d, "t": pt.t, "p": pt.p, "m": pt.m, "asked": schedule.value,
                   **plan_once(step, state, spec, cluster, method, flops, cfg.gpus)}
            s["manual"].append(got)
            out.save()
            _progress(f"{cfg.key}: manual d={pt.d} t={pt.t} p={pt.p} M={pt.m} as "
                      f"{schedule.value}: {got['status']} ({got.get('schedule')})")


# ---------------------------------------------------------------------------------------------
# Worker 2: the planning-time scale of one GPT layer count over cluster sizes.
# ---------------------------------------------------------------------------------------------

def _scale_worker(args) -> None:
    setup_worker()
    import jax
    import jax.numpy as jnp
    import optax
    from common import gpt_state_fn, gpt_train_step

    import autopar
    from autopar.models.gpt import GPT, GPTConfig, gpt_flops_per_token, gpt_loss
    layers = args.scale_layers_
    out = Saver(args.result_)
    r = out.data
    r.update(layers=layers, points=[], jax={"version": jax.__version__})
    mc = GPTConfig(num_layers=layers, dtype=jnp.float16, **SCALE_CFG)
    state = jax.eval_shape(gpt_state_fn(GPT(mc), optax.adamw(1e-4), mc.seq_len),
                           jax.random.key(0))
    step = gpt_train_step(gpt_loss, autopar.value_and_grad)
    spec = {"tokens": jax.ShapeDtypeStruct((SCALE_BATCH, mc.seq_len), jnp.int32)}
    flops = gpt_flops_per_token(mc) * SCALE_BATCH * mc.seq_len
    method = autopar.PipeshardParallel(
        num_microbatches=SCALE_MICROBATCHES,
        layer_option=autopar.AutoLayerOption(num_layers=SCALE_AUTO_LAYERS),
        stage_option=autopar.AutoStageOption(logical_shapes="flat"))
    for hosts in args.scale_hosts:
        cluster = autopar.ClusterSpec.preset(PRESET, num_hosts=hosts)
        _progress(f"scale L={layers}: {cluster.num_devices} devices ...")
        e = {"hosts": hosts, "devices": cluster.num_devices, "load": load_avg(),
             **plan_once(step, state, spec, cluster, method, flops, cluster.num_devices)}
        e.pop("stages", None)
        r["points"].append(e)
        out.save()
        _progress(f"scale L={layers} {cluster.num_devices} devices: {e['status']} in "
                  f"{e['wall_s']:.1f} s")


# ---------------------------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------------------------

def _child(argv: list[str], label: str, timeout_s: float) -> dict:
    return run_case(os.path.abspath(__file__), argv, label, timeout_s, "autopar_paper_",
                    _progress)


def selected(args) -> list[str]:
    keys = []
    for fam in FAMILIES:
        names = getattr(args, fam)
        names = DEFAULT[fam] if names is None else names
        keys += [c.key for c in FAMILIES[fam] if "all" in names or c.name in names]
    return keys


def run(args) -> dict:
    t0 = time.perf_counter()
    res: dict = {"started_utc": utc_now(), "load_start": load_avg(),
                 "revision_start": source_revision(), "configs": [], "scale": [],
                 "parts_s": {}}
    opts = ["--auto-budget-s", str(args.auto_budget_s), "--auto-tries", str(args.auto_tries),
            "--manual-budget-s", str(args.manual_budget_s), "--shapes", args.shapes,
            "--manual-mb", *map(str, args.manual_mb)]
    opts += ["--no-auto"] * args.no_auto + ["--no-manual"] * args.no_manual
    opts += ["--no-schedules"] * args.no_schedules
    for key in selected(args):
        t1 = time.perf_counter()
        r = _child(["--_case", key, *opts], key, args.case_timeout_s)
        r.setdefault("key", key)
        res["configs"].append(r)
        fam = ALL[key].family
        res["parts_s"][fam] = res["parts_s"].get(fam, 0.0) + time.perf_counter() - t1
    if not args.no_scale:
        t1 = time.perf_counter()
        for layers in args.scale_layers:
            r = _child(["--_scale", str(layers), "--scale-hosts", *map(str, args.scale_hosts)],
                       f"scale L={layers}", args.scale_timeout_s)
            r.setdefault("layers", layers)
            res["scale"].append(r)
        res["parts_s"]["scale"] = time.perf_counter() - t1
    res.update(total_s=time.perf_counter() - t0, load_end=load_avg(),
               revision_end=source_revision(), cmdline=args.cmdline,
               args={k: getattr(args, k) for k in (
                   "auto_budget_s", "auto_tries", "manual_budget_s", "manual_mb", "shapes",
                   "case_timeout_s", "scale_timeout_s", "scale_layers", "scale_hosts",
                   "no_auto", "no_manual", "no_scale", "no_schedules")})
    res["args"]["selected"] = selected(args)
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(res, f, indent=1)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    names = lambda fam: [c.name for c in FAMILIES[fam]]   # noqa: E731
    for fam in FAMILIES:
        p.add_argument(f"--{fam}", nargs="*", default=None, choices=[*names(fam), "all"],
                       help=f"{fam} sizes, or all (default: {' '.join(DEFAULT[fam])})")
    p.add_argument("--no-gpt", action="store_true")
    p.add_argument("--no-moe", action="store_true")
    p.add_argument("--no-wrn", action="store_true")
    p.add_argument("--no-auto", action="store_true", help="skip autopar's search")
    p.add_argument("--no-manual", action="store_true", help="skip the Megatron-style grid")
    p.add_argument("--no-scale", action="store_true", help="skip the planning-time scale part")
    p.add_argument("--no-schedules", action="store_true",
                   help="skip the schedule columns (Schedule.AUTO, interleaved manual plans)")
    p.add_argument("--auto-tries", type=int, default=3,
                   help="microbatch counts autopar tries: batch, batch/2, ... (this many)")
    p.add_argument("--auto-budget-s", type=float, default=40.0,
                   help="stop trying more microbatch counts once a configuration's autopar "
                        "planning time reaches this")
    p.add_argument("--manual-budget-s", type=float, default=30.0,
                   help="stop the manual grid of a configuration after this much planning")
    p.add_argument("--manual-mb", type=int, nargs="+", default=[1],
                   help="examples per microbatch per data-parallel replica in the grid")
    p.add_argument("--shapes", default="flat", choices=("flat", "all"),
                   help="AutoStageOption(logical_shapes=) of autopar's search")
    p.add_argument("--case-timeout-s", type=float, default=720.0)
    p.add_argument("--scale-layers", type=int, nargs="+", default=list(SCALE_LAYERS))
    p.add_argument("--scale-hosts", type=int, nargs="+", default=list(SCALE_HOSTS))
    p.add_argument("--scale-timeout-s", type=float, default=360.0)
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="the Markdown file to write (default: benchmarks/results/paper.md)")
    p.add_argument("--plot", default=None, help="where to save the scale plot (default: next "
                                                "to --out, <out>-scale.png)")
    p.add_argument("--save-json", default=None, help="also write the raw results here")
    p.add_argument("--from-json", default=None,
                   help="render the report from results saved by --save-json (runs nothing)")
    p.add_argument("--_case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_scale", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for fam in FAMILIES:
        if getattr(args, f"no_{fam}"):
            setattr(args, fam, [])
    args.result_ = args._result
    if args._case is not None:
        args.case_ = args._case
        _case_worker(args)
        return 0
    if args._scale is not None:
        args.scale_layers_ = args._scale
        _scale_worker(args)
        return 0
    args.cmdline = ("benchmarks/paper.py " + " ".join(
        sys.argv[1:] if argv is None else argv)).strip()
    res = results(args, run)
    text = write_outputs(res, args.out, args.plot)
    _progress(f"wrote {args.out}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
