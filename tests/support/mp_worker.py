"""Run by tests/runtime/test_launch.py in every process of
`python -m autopar launch --num-processes 2 --devices-per-process 4
tests/support/mp_worker.py OUT MODE`.

MODE "train" (or "train:NAME,NAME" for some of them): the tiny GPT for 3 steps under
ShardParallel, Zero3Parallel and 2-stage 1F1B and GPipe pipelines on the 2 x 4 (hosts x
devices) mesh; process 0 writes losses, gradients, final parameters and plan facts to
OUT/<method>.npz / .json, and every process writes its shards of a checkpoint of the final
state to OUT/ckpt_<method> and reads it back. MODE "die" (an MLP, quick to plan): process 1
kills itself after one step while process 0 keeps stepping (and fetching the loss, which
needs process 1).
"""
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import autopar
from support.steps import make_case, sgd_momentum_clip  # noqa: E402


def _pipeline(schedule):
    return autopar.PipeshardParallel(
        num_microbatches=4, schedule=schedule, layer_option=autopar.AutoLayerOption(num_layers=2),
        stage_option=autopar.UniformStageOption(num_stages=2))


METHODS = {
    "shard": autopar.ShardParallel(),
    "zero3": autopar.Zero3Parallel(),
    "pipe": _pipeline(autopar.Schedule.ONE_F_ONE_B),
    "gpipe": _pipeline(autopar.Schedule.GPIPE),
    "acc": autopar.ShardParallel(num_microbatches=4),   # accumulation: one executable
}


def flat(tree) -> list:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def train(out: str, name: str, mesh) -> None:
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(),
                                     value_and_grad=autopar.value_and_grad)
    # the step counter as a jax.jit-made state has it: a weakly typed array on one device
    # (each process must place it alike, or one re-plans alone at the next step and hangs)
    state = state.replace(step=jnp.asarray(0))
    assert state.step.weak_type
    par = autopar.parallelize(step, mesh=mesh, method=METHODS[name])
    plan = par.get_plan(state, batches[0])
    arrays = {}
    for i, b in enumerate(batches):
        state, loss, grads = par(state, b)
        arrays[f"loss_{i}"] = autopar.to_host(loss)
        for j, g in enumerate(flat(autopar.to_host(grads))):
            arrays[f"grad_{i}_{j}"] = g
    for j, p in enumerate(flat(autopar.to_host(state.params))):
        arrays[f"param_{j}"] = p
    # Both processes write one checkpoint (a pipeline's leaves each live on one process) and
    # read it back onto the plan's layout.
    path = os.path.join(out, f"ckpt_{name}")
    autopar.save_checkpoint(path, state, step=len(batches))
    restored = autopar.restore_checkpoint(path, par.input_shardings(state, batches[0])[0])
    restored_equal = all(np.array_equal(a, b) for a, b in zip(
        flat(autopar.to_host(restored)), flat(autopar.to_host(state))))
    if jax.process_index() == 0:
        np.savez(os.path.join(out, f"{name}.npz"), **arrays)
        facts = {"stages": [list(s.device_ids) for s in plan.stages],
                 "processes": [sorted({d.process_index for d in jax.devices()
                                       if d.id in s.device_ids}) for s in plan.stages],
                 "origin": plan.origin, "num_hosts": par.cluster.num_hosts,
                 "restored_equal": restored_equal}
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(facts, f)


def die(out: str, mesh) -> None:
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip())   # quick to plan
    par = autopar.parallelize(step, mesh=mesh)
    for i in range(10_000):
        state, loss, _ = par(state, batches[i % len(batches)])
        print(f"step {i} loss {float(autopar.to_host(loss)):.4f}", flush=True)
        if i == 1 and jax.process_index() == 1:
            with open(os.path.join(out, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    info = autopar.init_distributed()       # the launcher already joined: returns the info
    assert info.num_processes == 2, info
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    if mode == "die":
        die(out, mesh)
        return
    names = mode.partition(":")[2].split(",") if ":" in mode else list(METHODS)
    for name in names:                      # "train" or "train:shard,pipe"
        train(out, name, mesh)


if __name__ == "__main__":
    main()
