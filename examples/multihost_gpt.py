"""Train a small GPT as a multi-host job: one controller process per host, with autopar.

Try it on one machine (2 processes x 4 simulated CPU devices, one JAX job over 127.0.0.1):

    python -m autopar launch --num-processes 2 --devices-per-process 4 examples/multihost_gpt.py

On a real cluster, run this same script on every host (e.g. `srun python
examples/multihost_gpt.py`): `autopar.init_distributed()` reads SLURM's (or another
scheduler's) variables, or `JAX_COORDINATOR_ADDRESS`.

Every process runs the same code. autopar plans once on process 0 (or reads the plan cache)
and hands the plan to the others; the 2-stage pipeline below puts one stage on each host, and
activations cross hosts between them. Each process checks the losses against plain `jax.jit`
on one of its own devices, then all of them write one checkpoint together (each its shards),
and a restore onto the plan continues training.
"""
import os
import sys
import tempfile

import autopar  # noqa: E402  (init_distributed must run before any other JAX call)

INFO = autopar.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from autopar.models.gpt import GPT, GPTConfig, gpt_loss, make_gpt_batch  # noqa: E402

NUM_STEPS = 4
BATCH_SIZE = 16
TOLERANCE = 1e-4
CONFIG = GPTConfig(vocab_size=1024, seq_len=32, num_layers=4, hidden=128, num_heads=4)


def say(*parts) -> None:
    print(f"[host {INFO.process_id}/{INFO.num_processes}]", *parts, flush=True)


def create_state(key):
    model = GPT(CONFIG)
    params = model.init(key, jax.numpy.zeros((1, CONFIG.seq_len), jax.numpy.int32))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def train_step(state, batch):
    def loss_fn(params):
        return gpt_loss(state.apply_fn(params, batch["tokens"]), batch["tokens"])
    loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def main() -> int:
    hosts = jax.process_count()
    say(f"{len(jax.devices())} devices in the job, {len(jax.local_devices())} on this host")
    # hosts x devices per host: the first axis crosses hosts (the slow links).
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(hosts, -1), ("data", "model"))
    method = autopar.PipeshardParallel(
        num_microbatches=4, layer_option=autopar.AutoLayerOption(num_layers=2),
        stage_option=autopar.UniformStageOption(num_stages=2))
    step = autopar.parallelize(train_step, mesh=mesh, method=method)

    key = jax.random.key(0)
    state = create_state(key)          # every process builds the same values
    batches = [make_gpt_batch(jax.random.fold_in(key, 1 + i), BATCH_SIZE, CONFIG)
               for i in range(NUM_STEPS)]
    reference = jax.device_put(jax.tree_util.tree_map(np.array, state), jax.local_devices()[0])

    plan = step.get_plan(state, batches[0])
    if INFO.process_id == 0:
        print(autopar.dump(plan, max_rows=6), flush=True)
    for s in plan.stages:
        hosts_of = sorted({d.process_index for d in jax.devices() if d.id in s.device_ids})
        say(f"stage {s.index}: layers {s.layers} on devices {list(s.device_ids)} "
            f"(host {hosts_of})")

    single = jax.jit(train_step)
    worst = 0.0
    for i, batch in enumerate(batches):
        state, loss = step(state, batch)
        reference, ref_loss = single(reference, batch)
        loss, ref_loss = float(autopar.to_host(loss)), float(ref_loss)
        worst = max(worst, abs(loss - ref_loss) / abs(ref_loss))
        say(f"step {i}  loss {loss:.6f}  jax.jit on one device {ref_loss:.6f}")

    # One checkpoint, written by every host (each its own shards), restored onto the plan.
    job = (INFO.coordinator_address or "single").replace(":", "-")   # the same on every host
    path = os.environ.get("CHECKPOINT_DIR") or os.path.join(tempfile.gettempdir(),
                                                            f"autopar-multihost-{job}")
    autopar.save_checkpoint(path, state, step=NUM_STEPS)
    restored = autopar.restore_checkpoint(path, step.input_shardings(state, batches[0])[0],
                                          step=NUM_STEPS)
    _, loss_after = step(restored, batches[0])
    _, ref_after = single(reference, batches[0])
    loss_after, ref_after = float(autopar.to_host(loss_after)), float(ref_after)
    worst = max(worst, abs(loss_after - ref_after) / abs(ref_after))
    say(f"restored checkpoint {NUM_STEPS} from {path}: next loss {loss_after:.6f} "
        f"(jax.jit {ref_after:.6f})")
    if worst > TOLERANCE:
        say(f"MISMATCH: max relative loss difference {worst:.1e} > {TOLERANCE:.0e}")
        return 1
    say(f"matches single-device training: max relative loss difference {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
