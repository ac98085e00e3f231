"""Gradient accumulation: what M microbatches cost against the whole batch, next to the same
ratio for a hand-written `jax.jit` accumulator.

    .venv/bin/python benchmarks/accumulation.py      # -> benchmarks/results/accumulation.md
    .venv/bin/python benchmarks/accumulation.py --out /tmp/a.md

Per model (a GPT of 4 layers, hidden 256, 4 heads, seq 128, vocab 2048; a BERT MLM of the same
size, its loss a weighted mean over masked positions), batch 32, Adam, steps timed side by side
in one process on 8 simulated CPU devices:

- *autopar M=1*: `ShardParallel()` on a 2 x 4 mesh (the whole batch);
- *autopar M*: `ShardParallel(num_microbatches=M)` on the same mesh, M = 4 and 8, as autopar runs
  it (one executable, `lowering.accumulate`);
- *per-task M*: the same program run the way autopar ran accumulation before (one executable per
  microbatch, then the reduction and the update, dispatched from Python: the executor with
  `whole_step` set to None);
- *jit whole* and *jit scan M*: `jax.jit` on one device of the step, and of a hand-written
  accumulator (a `lax.scan` over M microbatches adding gradients into a carry, then the update).

The rounds interleave the configurations (each timed as the median of its steps, results
blocked on); the report gives each median and the ratios (autopar M / autopar M=1) and
(jit scan M / jit whole), and their quotient (the goal: <= 1.05). Both steps of a ratio ran in
the same rounds, so the machine's noise mostly cancels. `make bench` runs it.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from common import md_row, run_worker, section_head, section_main, section_tail

MODELS = ("gpt", "bert_mlm")
MICROBATCHES = (4, 8)
BATCH, SEQ, HIDDEN, HEADS, LAYERS, VOCAB = 32, 128, 256, 4, 4, 2048
ROUNDS, STEPS = 5, 3


def _case(name: str):
    """(loss_fn(params, batch), params, batch, apply) for a model."""
    import jax

    from autopar.models.bert import BertMLM, bert_batch, mlm_loss
    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch
    if name == "gpt":
        cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=LAYERS, hidden=HIDDEN,
                        num_heads=HEADS)
        net, batch = GPT(cfg), make_gpt_batch(jax.random.key(1), BATCH, cfg)
        params = net.init(jax.random.key(0), batch["tokens"])
        return (lambda p, b: gpt_loss(net.apply(p, b["tokens"]), b["tokens"])), params, batch
    net = BertMLM(vocab=VOCAB, seq=SEQ, hidden=HIDDEN, heads=HEADS, layers=LAYERS)
    batch = bert_batch(BATCH, SEQ, VOCAB)
    params = net.init(jax.random.key(0), batch["tokens"], batch["attention"])
    return (lambda p, b: mlm_loss(net.apply(p, b["tokens"], b["attention"]), b["labels"],
                                  b["weights"])), params, batch


def _steps(loss_fn, tx):
    """(autopar's step, jax.jit's whole-batch step, a scan accumulator of M microbatches)."""
    import jax
    import jax.numpy as jnp
    import optax

    import autopar

    def step_with(vg):
        def step(params, opt, batch):
            loss, grads = vg(loss_fn)(params, batch)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, loss
        return step

    def scan_step(m):
        def step(params, opt, batch):
            micro = jax.tree_util.tree_map(
                lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)

            def body(acc, b):
                loss, g = jax.value_and_grad(loss_fn)(params, b)
                return jax.tree_util.tree_map(jnp.add, acc, g), loss
            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            grads, losses = jax.lax.scan(body, zeros, micro)
            grads = jax.tree_util.tree_map(lambda g: g / m, grads)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, losses.mean()
        return step
    return step_with(autopar.value_and_grad), step_with(jax.value_and_grad), scan_step


def _timer(fn, args):
    """A callable timing one run of `fn(*args)` (blocked on), after a first (compiling) run."""
    import jax
    jax.block_until_ready(fn(*args))

    def once():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - t0
    return once


def _model_rows(name: str, mesh) -> dict:
    import dataclasses

    import jax
    import optax

    import autopar
    from autopar.runtime.executor import Executor
    loss_fn, params, batch = _case(name)
    tx = optax.adam(1e-3)
    opt = tx.init(params)
    par_step, jit_step, scan_step = _steps(loss_fn, tx)
    one = jax.devices()[0]
    on_one = jax.device_put((params, opt, batch), one)
    args = (params, opt, batch)
    timers, rows = {}, {"model": name}
    timers["jit whole"] = _timer(jax.jit(jit_step), on_one)
    par1 = autopar.parallelize(par_step, mesh=mesh, method=autopar.ShardParallel(),
                               batch_argnums=(2,), plan_cache=False)
    timers["autopar M=1"] = _timer(par1, args)
    for m in MICROBATCHES:
        timers[f"jit scan M={m}"] = _timer(jax.jit(scan_step(m)), on_one)
        par = autopar.parallelize(par_step, mesh=mesh,
                                  method=autopar.ShardParallel(num_microbatches=m),
                                  batch_argnums=(2,), plan_cache=False)
        timers[f"autopar M={m}"] = _timer(par, args)
        program = par.get_compiled(*args)
        rows[f"one_executable M={m}"] = program.whole_step is not None
        per_task = Executor(dataclasses.replace(program, whole_step=None))
        leaves = jax.tree_util.tree_leaves(args)
        flat = [jax.device_put(x, s) for x, s in zip(leaves, program.in_shardings)]
        timers[f"per-task M={m}"] = _timer(per_task.run, (flat,))
        got, want = par(*args)[2], jax.jit(jit_step)(*on_one)[2]
        rows[f"loss M={m}"] = (float(got), float(want))
    times = {k: [] for k in timers}
    for _ in range(ROUNDS):
        for k, once in timers.items():
            times[k].append(statistics.median(once() for _ in range(STEPS)))
    rows["median_s"] = {k: statistics.median(v) for k, v in times.items()}
    return rows


def _worker(out_path: str) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
    import jax
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
    rows = []
    for name in MODELS:
        try:
            rows.append(_model_rows(name, mesh))
        except Exception as e:          # noqa: BLE001 - a failed case is reported in its row
            rows.append({"model": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(f"accumulation: {name} done", file=sys.stderr, flush=True)
        with open(out_path, "w") as f:
            json.dump(rows, f)


def run(timeout_s: float = 1800) -> dict:
    return run_worker(__file__, [], timeout_s)


def section(res: dict, cmdline: str) -> str:
    out = section_head("Gradient accumulation", res, cmdline) + [
        f"Batch {BATCH}, seq {SEQ}, hidden {HIDDEN}, {LAYERS} layers, Adam. autopar on a 2 x 4 "
        "mesh of simulated CPU devices, jax.jit on one of them; each time the median over "
        f"{ROUNDS} interleaved rounds of the median of {STEPS} steps. *ratio* = step with M "
        "microbatches / whole-batch step of the same kind; *autopar vs jit* = autopar's ratio / "
        "jit's (goal <= 1.05). *per-task* = the same plan run one executable per microbatch "
        "(autopar's runtime before accumulation became one executable).", "",
        md_row(["model", "M", "autopar M=1 (ms)", "autopar M (ms)", "per-task M (ms)",
                "jit whole (ms)", "jit scan M (ms)", "autopar ratio", "per-task ratio",
                "jit ratio", "autopar vs jit", "loss (autopar / jit)"]),
        md_row(["---", "---:"] + ["---:"] * 10)]
    for row in res.get("rows", []):
        if "error" in row:
            out.append(md_row([row["model"], "", f"failed: {row['error']}"] + [""] * 9))
            continue
        t = row["median_s"]
        for m in MICROBATCHES:
            a, p = t[f"autopar M={m}"] / t["autopar M=1"], t[f"per-task M={m}"] / t["autopar M=1"]
            j = t[f"jit scan M={m}"] / t["jit whole"]
            got, want = row[f"loss M={m}"]
            out.append(md_row([
                row["model"], str(m), f"{t['autopar M=1'] * 1e3:.1f}",
                f"{t[f'autopar M={m}'] * 1e3:.1f}", f"{t[f'per-task M={m}'] * 1e3:.1f}",
                f"{t['jit whole'] * 1e3:.1f}", f"{t[f'jit scan M={m}'] * 1e3:.1f}",
                f"{a:.3f}", f"{p:.3f}", f"{j:.3f}", f"**{a / j:.3f}**",
                f"{got:.6f} / {want:.6f}"]))
    return section_tail(out, res)


def main(argv=None) -> int:
    return section_main(argv, doc=__doc__, key="accumulation", script="accumulation.py",
                        worker=_worker, run=run, section=section)


if __name__ == "__main__":
    sys.exit(main())
