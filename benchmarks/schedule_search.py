"""The schedule searched with the stages: `Schedule.AUTO` against 1F1B alone, planned.

    .venv/bin/python benchmarks/schedule_search.py    # -> benchmarks/results/schedule_search.md

A linen GPT (hidden 512, 8 heads, seq 256, vocab 8192, batch 32, adam) of 4 and 8 layers,
`AutoLayerOption(num_layers=L)` and the stage search (`AutoStageOption`), planned with
`autopar.plan` for one V100 host (`ClusterSpec.preset("v100-p3.16xlarge")`: 8 GPUs) with
M = 8 and 32 microbatches, without a budget and with budgets of 1.1 and 1.3 times the 1F1B
plan's own peak: once with `Schedule.ONE_F_ONE_B`, once with `Schedule.AUTO` (each
zero-bubble schedule's own stage DP, every layout priced under every table), side by side in
one process. Columns: each plan's wall time, predicted step, stages and schedule; the AUTO
step over 1F1B's and its planning time over 1F1B's. Then Alpa's GPT-6.7B on 16 V100s and
GPT-39B on 64 (`paper_configs.py`, built as `paper.py` does: float16, adamw, batch 1024,
`AutoLayerOption(num_layers=8)`, flat views) at M = 32 (6.7B only), 128 and 1024, planned
both ways the same way. Every step time is autopar's prediction; nothing here runs a step.
"""
from __future__ import annotations

import json
import sys
import time

from common import md_row, run_worker, section_head, section_main, section_tail, setup_worker

CFG = dict(vocab_size=8192, seq_len=256, hidden=512, num_heads=8)
LAYERS = (4, 8)
MICROBATCHES = (8, 32)
BUDGETS = (None, 1.1, 1.3)       # None: no budget; else x the 1F1B plan's peak without one
# (config, M), K = 8: M = 32, the low end of Alpa's grid for 6.7B, shows a pipeline whose
# bubble is large enough for a schedule to matter
PAPER = (("gpt-6.7B", 32), ("gpt-6.7B", 128), ("gpt-6.7B", 1024), ("gpt-39B", 1024))


def _worker(out_path: str) -> None:
    setup_worker(8)
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import autopar
    from autopar.models.gpt import GPT, GPTConfig, gpt_loss

    cluster = autopar.ClusterSpec.preset("v100-p3.16xlarge")
    rows = []

    def case(layers):
        model = GPT(GPTConfig(num_layers=layers, **CFG))
        tokens = jax.ShapeDtypeStruct((32, CFG["seq_len"]), jnp.int32)

        def create():
            params = model.init(jax.random.key(0), jnp.zeros((1, CFG["seq_len"]), jnp.int32))
            return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                                 tx=optax.adam(1e-3))

        def step(state, batch):
            def loss_fn(p):
                return gpt_loss(model.apply(p, batch["tokens"]), batch["tokens"])
            loss, grads = autopar.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), loss
        return step, jax.eval_shape(create), {"tokens": tokens}

    def planned(step, state, batch, layers, m, schedule, budget):
        method = autopar.PipeshardParallel(
            num_microbatches=m, schedule=schedule, memory_budget_bytes=budget,
            layer_option=autopar.AutoLayerOption(num_layers=layers))
        t = time.perf_counter()
        plan = autopar.plan(step, state, batch, cluster=cluster, method=method)
        return plan, time.perf_counter() - t

    def describe(plan):
        return "; ".join(f"L{s.layers[0]}-{s.layers[1]} {s.submesh[0]}x{s.submesh[1]}"
                         for s in plan.stages)

    for layers in LAYERS:
        step, state, batch = case(layers)
        for m in MICROBATCHES:
            free = None
            for factor in BUDGETS:
                row = {"layers": layers, "m": m, "budget_x": factor}
                try:
                    budget = None if factor is None else factor * free
                    row["budget"] = budget
                    one, row["one_s"] = planned(step, state, batch, layers, m,
                                                autopar.Schedule.ONE_F_ONE_B, budget)
                    if factor is None:
                        free = max(s.peak_memory_bytes for s in one.stages)
                    auto, row["auto_s"] = planned(step, state, batch, layers, m,
                                                  autopar.Schedule.AUTO, budget)
                    row.update(one_step=one.pipeline["predicted_latency_s"],
                               auto_step=auto.pipeline["predicted_latency_s"],
                               one_stages=describe(one), auto_stages=describe(auto),
                               schedule=auto.pipeline["schedule"],
                               same_layout=describe(one) == describe(auto))
                except Exception as e:      # noqa: BLE001 - reported in its row
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                print(f"schedule_search: L={layers} M={m} budget {factor} done",
                      file=sys.stderr, flush=True)
                with open(out_path, "w") as f:
                    json.dump(rows, f)
    _paper_rows(rows, out_path, describe)


def _paper_rows(rows: list, out_path: str, describe) -> None:
    """Alpa's GPT-6.7B and GPT-39B (PAPER), 1F1B then AUTO, on V100 hosts."""
    from paper import build
    from paper_configs import ALL, cluster_shape

    import autopar

    for key, m in PAPER:
        cfg = ALL[key]
        step, state, spec = build(cfg)[:3]
        hosts, dph = cluster_shape(cfg.gpus)
        cluster = autopar.ClusterSpec.preset("v100-p3.16xlarge", num_hosts=hosts).with_(
            devices_per_host=dph)
        row = {"paper": key, "gpus": cfg.gpus, "m": m}
        try:
            for name, schedule in (("one", autopar.Schedule.ONE_F_ONE_B),
                                   ("auto", autopar.Schedule.AUTO)):
                method = autopar.PipeshardParallel(
                    num_microbatches=m, schedule=schedule,
                    layer_option=autopar.AutoLayerOption(num_layers=8),
                    stage_option=autopar.AutoStageOption(logical_shapes="flat"))
                t = time.perf_counter()
                plan = autopar.plan(step, state, spec, cluster=cluster, method=method)
                row[f"{name}_s"] = time.perf_counter() - t
                row[f"{name}_step"] = plan.pipeline["predicted_latency_s"]
                row[f"{name}_stages"] = describe(plan)
                row["schedule"] = plan.pipeline["schedule"]
            row["same_layout"] = row["one_stages"] == row["auto_stages"]
        except Exception as e:      # noqa: BLE001 - reported in its row
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(f"schedule_search: {key} M={m} done", file=sys.stderr, flush=True)
        with open(out_path, "w") as f:
            json.dump(rows, f)


def run(timeout_s: float = 2400) -> dict:
    return run_worker(__file__, [], timeout_s)


COMPARED = ["1F1B plan (s)", "AUTO plan (s)", "plan time", "1F1B stages", "AUTO schedule",
            "AUTO stages", "AUTO / 1F1B"]


def _table(rows, keys: list[str], aligns: list[str], key_cells) -> list[str]:
    """A table of 1F1B-vs-AUTO rows: `key_cells(row)` then the compared columns."""
    out = [md_row(keys + COMPARED),
           md_row(aligns + ["---:", "---:", "---:", "---", "---", "---", "---:"])]
    for row in rows:
        if "error" in row:
            out.append(md_row(key_cells(row) + [f"failed: {row['error']}"] + [""] * 6))
            continue
        out.append(md_row(key_cells(row) + [
            f"{row['one_s']:.1f}", f"{row['auto_s']:.1f}", f"{row['auto_s'] / row['one_s']:.2f}",
            row["one_stages"], row["schedule"],
            "same" if row["same_layout"] else row["auto_stages"],
            f"{row['auto_step'] / row['one_step']:.3f}"]))
    return out


def section(res: dict, cmdline: str) -> str:
    rows = res.get("rows", [])
    out = section_head("The schedule searched with the stages (Schedule.AUTO vs 1F1B)", res,
                       cmdline) + [
        "A linen GPT (hidden 512, seq 256, batch 32, adam), `AutoStageOption`, planned for one "
        "V100 host (8 GPUs, `ClusterSpec.preset(\"v100-p3.16xlarge\")`); budget: none, or x "
        "the 1F1B plan's peak without one. *AUTO / 1F1B*: predicted step (below 1: AUTO "
        "faster); *plan time*: AUTO's planning wall time over 1F1B's, both in this process, "
        "one after the other (the issue's bound: 1.5). Predicted, not measured.", ""]
    out += _table([r for r in rows if "paper" not in r], ["layers", "M", "budget"],
                  ["---:", "---:", "---"], lambda r: [
                      str(r["layers"]), str(r["m"]),
                      "none" if r["budget_x"] is None else f"{r['budget_x']}x"])
    paper = [r for r in rows if "paper" in r]
    if paper:
        out += ["", "Alpa's GPT-6.7B (16 V100s) and GPT-39B (64), K = 8 auto layers, flat "
                "views, no budget beyond the 16 GB of a V100 (*AUTO / 1F1B*: predicted step; "
                "the issue's goal is <= 1/1.10 = 0.909):", ""]
        out += _table(paper, ["model", "GPUs", "M"], ["---", "---:", "---:"],
                      lambda r: [r["paper"], str(r["gpus"]), str(r["m"])])
    return section_tail(out, res)


if __name__ == "__main__":
    sys.exit(section_main(sys.argv[1:], doc=__doc__, key="schedule_search",
                          script="schedule_search.py", worker=_worker, run=run,
                          section=section))
