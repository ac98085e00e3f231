"""Planning under a binding memory budget: searches, planning time, predicted vs compiled.

    .venv/bin/python benchmarks/budget_plan.py            # -> benchmarks/results/budget_plan.md

The attention LM of issue 24 (linen GPT: 4 layers, hidden 64, 4 heads, seq 256, vocab 256,
batch 16, SGD) on a 2 x 4 mesh with `ShardParallel(memory_budget_bytes=B)`, `remat="auto"`
(the default), B = 70% of the least memory any plan without recomputation needs (the
`needed_bytes` of the InfeasiblePlanError a 1000-byte budget raises). Per gradient API: the
budget, the wall time of `get_plan` (searches and the compile check included), how many plan
searches ran (one, plus one per re-plan `autopar.verify.memory_check` logs), the plan's
recomputation, its predicted peak, the peak its search counted (`plan.ilp["peak_bytes"]`:
the ILP's memory rows, which leave the resharded copies out) and what XLA compiled it to.

Second, where the rows count more than the prediction (temporaries XLA places in the buffers
of the step's results): the suite's 2-layer GPT (vocab 128, seq 16, hidden 32, 4 heads, batch
16, SGD with momentum and clipping, `jax.value_and_grad`) on 2 x 4 at budgets of 1.05 and
1.2 times its free plan's predicted peak; the same columns plus the plan's predicted step
time over the free plan's.
"""
from __future__ import annotations

import json
import logging
import sys
import time

from common import (
    gpt_state_fn,
    gpt_train_step,
    md_row,
    run_worker,
    section_head,
    section_main,
    section_tail,
    setup_worker,
)

APIS = ("jax.value_and_grad", "autopar.value_and_grad")
OVER_COUNT = (1.05, 1.2)     # budgets for the small GPT, times its free plan's predicted peak
LM = dict(vocab_size=256, seq_len=256, num_layers=4, hidden=64, num_heads=4)
SMALL = dict(vocab_size=128, seq_len=16, num_layers=2, hidden=32, num_heads=4)


def _case(cfg_kw: dict, tx, value_and_grad):
    """(step, (state, batch)) of a linen GPT with `GPTConfig(**cfg_kw)`, batch 16."""
    import jax

    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch
    cfg = GPTConfig(**cfg_kw)
    state = gpt_state_fn(GPT(cfg), tx, cfg.seq_len)(jax.random.key(0))
    return (gpt_train_step(gpt_loss, value_and_grad),
            (state, make_gpt_batch(jax.random.key(1), 16, cfg)))


class _Replans(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        msg = record.getMessage()
        self.count += "re-planning" in msg or "searching once more" in msg


def _measure(row: dict, par, args, replans) -> object:
    replans.count = 0
    t0 = time.perf_counter()
    plan = par.get_plan(*args)
    row["plan_s"] = time.perf_counter() - t0
    row["searches"] = 1 + replans.count
    row["remat"] = "/".join(plan.remat["layers"]) if plan.remat else "none"
    row["predicted"] = plan.peak_memory_bytes
    row["search_peak"] = plan.ilp.get("peak_bytes")
    row["compiled"] = plan.measured.get("compiled_bytes")
    row["check_rounds"] = plan.measured.get("memory_check_rounds")
    return plan


def _worker(out_path: str) -> None:
    setup_worker(8)
    import jax
    import optax

    import autopar
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    replans = _Replans()
    logging.getLogger("autopar").addHandler(replans)
    logging.getLogger("autopar").setLevel(logging.INFO)
    rows = []

    def add(row: dict, fill) -> None:
        """`fill(row)`, or the error it raised in the row; the rows so far saved."""
        try:
            fill(row)
        except Exception as e:      # noqa: BLE001 - a failed case is reported in its row
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(f"budget_plan: {row['api']} done", file=sys.stderr, flush=True)
        with open(out_path, "w") as f:
            json.dump(rows, f)

    def at_budget(step, budget):
        return autopar.parallelize(step, mesh=mesh, plan_cache=False, method=(
            autopar.ShardParallel(memory_budget_bytes=budget)))

    def lm(row):
        vg = jax.value_and_grad if row["api"] == "jax.value_and_grad" else \
            autopar.value_and_grad
        step, args = _case(LM, optax.sgd(0.1), vg)
        try:
            autopar.parallelize(step, mesh=mesh, plan_cache=False, method=autopar.ShardParallel(
                remat="none", memory_budget_bytes=1000)).get_plan(*args)
            raise RuntimeError("a 1000-byte budget was met")
        except autopar.InfeasiblePlanError as e:
            row["least"] = e.needed_bytes
        row["budget"] = int(0.7 * row["least"])
        _measure(row, at_budget(step, row["budget"]), args, replans)

    for api in APIS:
        add({"api": api}, lm)
    step, args = _case(SMALL, optax.chain(optax.clip_by_global_norm(1.0),
                                          optax.sgd(0.05, momentum=0.9)), jax.value_and_grad)
    free = autopar.parallelize(step, mesh=mesh, plan_cache=False).get_plan(*args)

    def small(factor):
        def fill(row):
            row["budget"] = int(factor * free.peak_memory_bytes)
            plan = _measure(row, at_budget(step, row["budget"]), args, replans)
            row["vs_free"] = plan.predicted_step_s / free.predicted_step_s
        return fill

    for factor in OVER_COUNT:
        add({"api": f"small GPT at {factor}x its free peak"}, small(factor))


def run(timeout_s: float = 1800) -> dict:
    return run_worker(__file__, [], timeout_s)


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def section(res: dict, cmdline: str) -> str:
    out = section_head("Planning under a binding memory budget", res, cmdline) + [
        "The attention LM (4 layers, seq 256) on 2 x 4 at 70% of its least memory without "
        "recomputation, and the 2-layer GPT at 1.05 and 1.2 times its free plan's predicted "
        "peak (where the search's rows count temporaries XLA places in the results' buffers: "
        "more than the prediction). *searches*: plan searches (1 + the re-plans and second "
        "searches logged); *search peak*: the peak the ILP's memory rows count; *step / "
        "free*: the plan's predicted step time over the plan without a budget; sizes in MB "
        "per device.", "",
        md_row(["case", "budget", "plan (s)", "searches", "recomputation", "predicted",
                "search peak", "compiled", "compile re-plans", "step / free"]),
        md_row(["---", "---:", "---:", "---:", "---", "---:", "---:", "---:", "---:", "---:"])]
    for row in res.get("rows", []):
        if "error" in row:
            out.append(md_row([row["api"], f"failed: {row['error']}"] + [""] * 8))
            continue
        vs_free = f"{row['vs_free']:.3f}" if "vs_free" in row else "-"
        out.append(md_row([row["api"], _mb(row["budget"]), f"{row['plan_s']:.1f}",
                           str(row["searches"]), row["remat"], _mb(row["predicted"]),
                           _mb(row["search_peak"]), _mb(row["compiled"]),
                           str(row["check_rounds"]), vs_free]))
    return section_tail(out, res)


if __name__ == "__main__":
    sys.exit(section_main(sys.argv[1:], doc=__doc__, key="budget_plan",
                          script="budget_plan.py", worker=_worker, run=run, section=section))
