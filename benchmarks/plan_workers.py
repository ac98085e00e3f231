"""Planning time with 1 and 2 (or more) worker processes, side by side: GPT configurations of
`paper_configs.py` on the V100 preset, planned from abstract arguments with `autopar.plan`
(as `paper.py` builds them), `PipeshardParallel(num_microbatches=M, layer_option=
AutoLayerOption(num_layers=K), stage_option=AutoStageOption(logical_shapes=S, workers=W))`.

Run from the repository root; it rewrites benchmarks/results/plan_workers.md:

    .venv/bin/python benchmarks/plan_workers.py                  # GPT-39B, K=8 and 16, M=64
    .venv/bin/python benchmarks/plan_workers.py --gpt 6.7B 39B --layers 8 --shapes flat \\
        --workers 1 2 4 --timeout-s 900 --out /tmp/w.md

Each plan runs in its own child process with a time limit; a stopped one reports how far the
search got (the stage search's last progress line). The machine is shared: the load average
at the start of each run is in the table.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time

from common import (
    Saver,
    load_avg,
    progress,
    result_path,
    results,
    run_case,
    setup_worker,
    source_revision,
    utc_now,
    write_result,
)
from paper_configs import ALL, GPT

KEY = "plan_workers"


def _progress(msg: str) -> None:
    progress("workers", msg)


class _Last(logging.Handler):
    """Keeps the search's latest progress line in the saved result."""

    def __init__(self, out: Saver):
        super().__init__(logging.INFO)
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("autopar.inter_op") and "[planning worker" not in \
                record.getMessage():
            self.out.data["last_progress"] = record.getMessage()
            self.out.data["last_progress_s"] = time.perf_counter() - self.out.data["t0"]
            self.out.save()


def _worker(args) -> None:
    setup_worker()
    from paper import build, make_cluster, plan_once

    import autopar
    cfg = ALL[args.case_]
    out = Saver(args.result_)
    out.data.update(key=cfg.key, gpus=cfg.gpus, layers=args.layers_, m=args.m_,
                    shapes=args.shapes_, workers=args.workers_, load=load_avg(),
                    t0=time.perf_counter())
    step, state, spec, flops, *_ = build(cfg)
    cluster = make_cluster(cfg.gpus)
    lg = logging.getLogger("autopar.inter_op")
    lg.setLevel(logging.INFO)
    lg.addHandler(_Last(out))
    method = autopar.PipeshardParallel(
        num_microbatches=args.m_, layer_option=autopar.AutoLayerOption(num_layers=args.layers_),
        stage_option=autopar.AutoStageOption(logical_shapes=args.shapes_,
                                             workers=args.workers_))
    out.data["t0"] = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    out.data.update(plan_once(step, state, spec, cluster, method, flops, cfg.gpus))
    # CPU seconds of the planner (this process) and of its finished worker processes: what
    # the planning costs apart from the machine's load.
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    out.data.update(cpu_s=cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
                    worker_cpu_s=kids.ru_utime + kids.ru_stime)
    out.save()


def run(args) -> dict:
    res = {"started_utc": utc_now(), "revision": source_revision(), "runs": [],
           "cmdline": args.cmdline}
    for name in args.gpt:
        for shapes in args.shapes:
            for layers in args.layers:
                for w in args.workers:
                    label = f"gpt-{name} K={layers} M={args.microbatches} {shapes} workers={w}"
                    r = run_case(os.path.abspath(__file__), [
                        "--_case", f"gpt-{name}", "--_layers", str(layers), "--_m",
                        str(args.microbatches), "--_shapes", shapes, "--_workers", str(w)],
                        label, args.timeout_s, "autopar_workers_", _progress)
                    r.update(key=f"gpt-{name}", layers=layers, m=args.microbatches,
                             shapes=shapes, workers=w, timeout_s=args.timeout_s)
                    res["runs"].append(r)
                    _progress(f"{label}: {r.get('status', 'stopped')} "
                              f"{r.get('wall_s', r['process_wall_s']):.1f} s")
                    if args.save_json:
                        with open(args.save_json, "w") as f:
                            json.dump(res, f, indent=1)
    return res


def _cell(r: dict) -> str:
    if r.get("status") in ("ok", "infeasible"):
        return f"{r['status']} in {r['wall_s']:.1f} s"
    if r.get("status") == "error":
        return f"error after {r['wall_s']:.1f} s: {r['message'][:120]}"
    got = r.get("last_progress")
    return (f"not done in {r['timeout_s']:.0f} s" + (
        f"; at {r['last_progress_s']:.0f} s of planning: \"{got}\"" if got else ""))


def section(res: dict) -> str:
    lines = ["## Planning in worker processes", "",
             f"Run {res['started_utc']} UTC at {res['revision']}: `{res['cmdline']}`. "
             "GPT configurations of `benchmarks/paper_configs.py` on "
             "`ClusterSpec.preset(\"v100-p3.16xlarge\")`, planned from abstract arguments "
             "(`autopar.plan`), method `PipeshardParallel(num_microbatches=M, layer_option="
             "AutoLayerOption(num_layers=K), stage_option=AutoStageOption(logical_shapes=S, "
             "workers=W))`; each plan in its own process with a time limit. Wall time is "
             "`autopar.plan`'s, tracing included. The machine has 2 cores shared with other "
             "work: the load average at each run's start is given.", "",
             "| config | GPUs | K | M | S | W | outcome | CPU s: planner + workers | ILPs "
             "solved / reused | predicted TFLOPS/GPU | load | speed-up vs W=1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in res["runs"]:
        k = (r["key"], r["layers"], r["m"], r["shapes"])
        ok = r.get("status") in ("ok", "infeasible")
        if r["workers"] == 1 and ok:
            base[k] = r["wall_s"]
        pl = r.get("pipeline") or {}
        speed = (f"{base[k] / r['wall_s']:.2f}x" if ok and k in base and r["workers"] > 1
                 else "–")
        tflops = f"{r['tflops']:.1f}" if "tflops" in r else "–"
        load = r.get("load") or ["–"]
        cpu = (f"{r['cpu_s']:.0f} + {r['worker_cpu_s']:.0f}" if "cpu_s" in r else
               "not measured")
        lines.append(
            f"| {r['key']} | {ALL[r['key']].gpus} | {r['layers']} | {r['m']} | {r['shapes']} "
            f"| {r['workers']} | {_cell(r)} | {cpu} | {pl.get('num_ilps', '–')} / "
            f"{pl.get('num_reused', '–')} | {tflops} | {load[0]} | {speed} |")
    lines += [""] + [f"- {n}" for n in res.get("notes", [])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--gpt", nargs="+", default=["39B"], choices=[c.name for c in GPT])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 16])
    p.add_argument("--microbatches", type=int, default=64)
    p.add_argument("--shapes", nargs="+", default=["all"], choices=("all", "flat"))
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=result_path(KEY),
                   help="the Markdown file to write (default: benchmarks/results/plan_workers.md)")
    p.add_argument("--save-json", default=None)
    p.add_argument("--from-json", default=None, help="render saved results (runs nothing)")
    for a in ("--_case", "--_shapes", "--_result"):
        p.add_argument(a, default=None, help=argparse.SUPPRESS)
    for a in ("--_layers", "--_m", "--_workers"):
        p.add_argument(a, type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._case:
        _worker(argparse.Namespace(**{k.lstrip("_") + "_": v for k, v in vars(args).items()
                                      if k.startswith("_")}))
        return 0
    args.cmdline = "benchmarks/plan_workers.py " + " ".join(argv if argv is not None
                                                            else sys.argv[1:])
    res = results(args, run)
    text = section(res)
    write_result(text, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
