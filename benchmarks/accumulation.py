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
  accumulator (a `lax.scan` over M microbatches adding gradients into a carry, then the update);
- *mesh jit whole* and *mesh jit scan M*: the same two `jax.jit` steps on the same 8 devices,
  written as a user would write data parallelism by hand: parameters and optimizer state
  replicated, the batch split over both mesh axes, each scan microbatch made of every M-th
  example (so it stays split over the same devices) and constrained to the widest split its
  size allows (8 devices, else the 4 of `model`).

The rounds interleave the configurations (each timed as the median of its steps, results
blocked on); the report gives each median and the ratios (autopar M / autopar M=1) and
(jit scan M / jit whole), and their quotient (the goal: <= 1.05); the same quotient against the
hand-written steps on the mesh says what a user's own accumulator costs on the same devices.
Both steps of a ratio ran in the same rounds, so the machine's noise mostly cancels.
`make bench` runs it.
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

    import autopar
    return (_step_with(loss_fn, tx, autopar.value_and_grad),
            _step_with(loss_fn, tx, jax.value_and_grad),
            lambda m: _scan_step(loss_fn, tx, m, lambda x: x.reshape(m, x.shape[0] // m,
                                                                     *x.shape[1:])))


def _step_with(loss_fn, tx, vg):
    import optax

    def step(params, opt, batch):
        loss, grads = vg(loss_fn)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss
    return step


def _scan_step(loss_fn, tx, m: int, micro_of):
    """A hand-written accumulator: `micro_of` splits each batch leaf into (m, rows, ...), a
    `lax.scan` adds the microbatches' gradients into a carry, then one update."""
    import jax
    import jax.numpy as jnp
    import optax

    def step(params, opt, batch):
        def body(acc, b):
            loss, g = jax.value_and_grad(loss_fn)(params, b)
            return jax.tree_util.tree_map(jnp.add, acc, g), loss
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(body, zeros, jax.tree_util.tree_map(micro_of, batch))
        grads = jax.tree_util.tree_map(lambda g: g / m, grads)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, losses.mean()
    return step


def _mesh_scan_step(loss_fn, tx, mesh, m: int):
    """A hand-written data-parallel accumulator on `mesh` (Auto axes): microbatch i holds
    examples i, i + m, ..., split over every device when its size allows, else over `model`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    rows = BATCH // m
    spec = (PartitionSpec(None, mesh.axis_names) if rows % mesh.size == 0
            else PartitionSpec(None, mesh.axis_names[-1]))
    return _scan_step(loss_fn, tx, m, lambda x: jax.lax.with_sharding_constraint(
        jnp.swapaxes(x.reshape(rows, m, *x.shape[1:]), 0, 1), NamedSharding(mesh, spec)))


def _on_mesh(args, mesh):
    """(params, opt, batch) placed for the hand-written data-parallel steps."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    params, opt, batch = args
    whole = NamedSharding(mesh, PartitionSpec())
    split = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    return (jax.device_put(params, whole), jax.device_put(opt, whole),
            jax.device_put(batch, split))


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
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names)      # Auto axes, as users write
    on_mesh = _on_mesh(args, auto)
    timers["mesh jit whole"] = _timer(jax.jit(jit_step), on_mesh)
    par1 = autopar.parallelize(par_step, mesh=mesh, method=autopar.ShardParallel(),
                               batch_argnums=(2,), plan_cache=False)
    timers["autopar M=1"] = _timer(par1, args)
    for m in MICROBATCHES:
        timers[f"jit scan M={m}"] = _timer(jax.jit(scan_step(m)), on_one)
        timers[f"mesh jit scan M={m}"] = _timer(
            jax.jit(_mesh_scan_step(loss_fn, tx, auto, m)), on_mesh)
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
        "mesh of simulated CPU devices; *jit* on one of them; *mesh jit* a hand-written "
        "data-parallel step on the same 8 devices (see the script's docstring). Each time is "
        f"the median over {ROUNDS} interleaved rounds of the median of {STEPS} steps. *ratio* = "
        "step with M microbatches / whole-batch step of the same kind; *autopar vs jit* = "
        "autopar's ratio / jit's (the issue's goal: <= 1.05); *autopar vs mesh jit* = autopar's "
        "ratio / the hand-written mesh step's. *per-task* = the same plan run one executable "
        "per microbatch (autopar's runtime before accumulation became one executable).", "",
        md_row(["model", "M", "autopar M=1 (ms)", "autopar M (ms)", "jit whole (ms)",
                "jit scan M (ms)", "mesh jit whole (ms)", "mesh jit scan M (ms)",
                "autopar ratio", "per-task ratio", "jit ratio", "mesh jit ratio",
                "autopar vs jit", "autopar vs mesh jit", "loss (autopar / jit)"]),
        md_row(["---", "---:"] + ["---:"] * 13)]
    for row in res.get("rows", []):
        if "error" in row:
            out.append(md_row([row["model"], "", f"failed: {row['error']}"] + [""] * 12))
            continue
        t = row["median_s"]
        for m in MICROBATCHES:
            a, p = t[f"autopar M={m}"] / t["autopar M=1"], t[f"per-task M={m}"] / t["autopar M=1"]
            j = t[f"jit scan M={m}"] / t["jit whole"]
            mj = t[f"mesh jit scan M={m}"] / t["mesh jit whole"]
            got, want = row[f"loss M={m}"]
            out.append(md_row([
                row["model"], str(m), *(f"{t[k] * 1e3:.1f}" for k in (
                    "autopar M=1", f"autopar M={m}", "jit whole", f"jit scan M={m}",
                    "mesh jit whole", f"mesh jit scan M={m}")),
                f"{a:.3f}", f"{p:.3f}", f"{j:.3f}", f"{mj:.3f}", f"**{a / j:.3f}**",
                f"**{a / mj:.3f}**", f"{got:.6f} / {want:.6f}"]))
    return section_tail(out, res)


def main(argv=None) -> int:
    return section_main(argv, doc=__doc__, key="accumulation", script="accumulation.py",
                        worker=_worker, run=run, section=section)


if __name__ == "__main__":
    sys.exit(main())
