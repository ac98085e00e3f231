"""Shared resharded copies: the plain ILP's plan next to the shared ILP's (intra_op/copies.py).

    .venv/bin/python benchmarks/shared_copies.py          # -> benchmarks/results/shared_copies.md

Each step is planned twice in one process, side by side: with the plain ILP only (every read
of a moved value charged its move; `intra_op.solve.SHARE_COPIES` off) and as autopar plans it
(the shared ILP solved after it, from its plan, and used where it proves a faster one). Per
plan: the planning time, the ILP's note on the shared copies, the predicted step (both priced
with each shared copy moved once) and the compiled collectives. Cases: a top-2 MoE layer and
a 2-layer MoE LM (tests/support/layer_models.py; batch pinned to the mesh axis, SGD) on 1 x 4,
and linen GPTs (hidden 256, 8 heads, vocab 1024, seq 64, batch 16, adamw) of 2 and 3 layers on
2 x 4.
"""
from __future__ import annotations

import json
import os
import sys
import time

from common import (
    REPO,
    collective_kinds,
    md_row,
    run_worker,
    section_head,
    section_main,
    section_tail,
)


def _support_case(name):
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from support import layer_models
    step, state, batch = getattr(layer_models, name)()
    return step, (state, batch)


def _gpt(layers):
    import jax
    import optax
    from flax.training import train_state

    from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch
    cfg = GPTConfig(vocab_size=1024, seq_len=64, num_layers=layers, hidden=256, num_heads=8)
    net, batch = GPT(cfg), make_gpt_batch(jax.random.key(1), 16, cfg)
    state = train_state.TrainState.create(
        apply_fn=net.apply, params=net.init(jax.random.key(0), batch["tokens"]),
        tx=optax.adamw(1e-3))

    def step(state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: gpt_loss(state.apply_fn(p, batch["tokens"]), batch["tokens"]))(state.params)
        return state.apply_gradients(grads=grads), loss
    return step, (state, batch)


CASES = (("MoE layer", lambda: _support_case("moe_layer_case"), (1, 4), True),
         ("MoE LM, 2 layers", lambda: _support_case("moe_lm_case"), (1, 4), True),
         ("GPT, 2 layers", lambda: _gpt(2), (2, 4), False),
         ("GPT, 3 layers", lambda: _gpt(3), (2, 4), False))


def _worker(out_path: str) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
    import jax

    import autopar
    from autopar.cost.hlo import collectives, summary
    from autopar.intra_op.solve import SHARE_COPIES
    rows = []
    for name, make, shape, pin in CASES:
        step, args = make()
        mesh = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:shape[0] * shape[1]])
        axis = "model" if shape[1] > 1 else "data"
        method = autopar.ShardParallel(sharding_rules=((r"^batch", (axis,)),) if pin else ())
        for shared in (False, True):
            row = {"case": name, "mesh": "x".join(map(str, shape)), "shared": shared}
            token = SHARE_COPIES.set(shared)
            try:
                par = autopar.parallelize(step, mesh=mesh, method=method, plan_cache=False)
                t0 = time.perf_counter()
                plan = par.get_plan(*args)
                row["plan_s"] = time.perf_counter() - t0
                row["step_s"] = plan.predicted_step_s
                row["note"] = plan.ilp["message"].split("; ")[-1]
                row["compiled"] = summary(collectives(par.get_compiled(*args).as_text()))
            except Exception as e:      # noqa: BLE001 - a failed case is reported in its row
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                SHARE_COPIES.reset(token)
            rows.append(row)
            print(f"shared_copies: {name} {'shared' if shared else 'plain'} done",
                  file=sys.stderr, flush=True)
            with open(out_path, "w") as f:
                json.dump(rows, f)


def run(timeout_s: float = 1800) -> dict:
    return run_worker(__file__, [], timeout_s)


def section(res: dict, cmdline: str) -> str:
    out = section_head("Shared resharded copies (plain ILP vs shared ILP)", res, cmdline) + [
        "Each case planned twice in one process: *plain*, the ILP that charges every read of a "
        "moved value its move; *shared*, as autopar plans (the shared ILP after it, used where "
        "it proves a faster plan). Predicted steps count each shared copy once in both.", "",
        md_row(["case", "mesh", "ILP", "plan (s)", "predicted step (ms)", "note",
                "compiled collectives"]),
        md_row(["---", "---", "---", "---:", "---:", "---", "---"])]
    for row in res.get("rows", []):
        kind = "shared" if row["shared"] else "plain"
        if "error" in row:
            out.append(md_row([row["case"], row["mesh"], kind, f"failed: {row['error']}",
                               "", "", ""]))
            continue
        out.append(md_row([row["case"], row["mesh"], kind, f"{row['plan_s']:.2f}",
                           f"{row['step_s'] * 1e3:.4f}", row["note"],
                           collective_kinds(row["compiled"])]))
    return section_tail(out, res)


if __name__ == "__main__":
    sys.exit(section_main(sys.argv[1:], doc=__doc__, key="shared_copies",
                          script="shared_copies.py", worker=_worker, run=run, section=section))
