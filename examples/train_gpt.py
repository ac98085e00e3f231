"""Train a small GPT with autopar on 8 simulated CPU devices, and check it against plain jax.jit.

Run from the repository root:

    python examples/train_gpt.py        # or: make demo

The step is an ordinary flax `TrainState` step. `@autopar.parallelize` traces it, picks a
sharding for every tensor with an ILP over a 2 x 4 ("data", "model") mesh, and runs it. The
same steps are then run with `jax.jit` on one device from the same initial state; the losses
must agree (fp32) or the script exits with status 1.
"""
import os
import sys
import time

# 8 simulated devices; must be set before jax is imported. On a real GPU/TPU mesh you need
# none of this: build your mesh from the real devices and pass it to `parallelize`.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import autopar  # noqa: E402
from autopar.models.gpt import GPT, GPTConfig, gpt_loss, gpt_param_count, make_gpt_batch  # noqa: E402

NUM_STEPS = 10
BATCH_SIZE = 16
TOLERANCE = 1e-4
CONFIG = GPTConfig(vocab_size=2048, seq_len=64, num_layers=2, hidden=256, num_heads=4)


def short_dump(plan) -> str:
    """`autopar.dump` (concise: the heaviest operators, repeated layers folded) with source
    paths relative to the repo."""
    return autopar.dump(plan).replace(REPO_ROOT + os.sep, "")


def create_state(key):
    model = GPT(CONFIG)
    params = model.init(key, jax.numpy.zeros((1, CONFIG.seq_len), jax.numpy.int32))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def train_step(state, batch):
    def loss_fn(params):
        return gpt_loss(state.apply_fn(params, batch["tokens"]), batch["tokens"])
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def main() -> int:
    t_start = time.perf_counter()
    devices = jax.devices()
    print(f"jax {jax.__version__}: {len(devices)} {devices[0].platform} devices")
    print(f"GPT: {CONFIG.num_layers} layers, hidden {CONFIG.hidden}, {CONFIG.num_heads} heads, "
          f"vocab {CONFIG.vocab_size}, seq {CONFIG.seq_len}: "
          f"{gpt_param_count(CONFIG) / 1e6:.2f} M parameters; batch {BATCH_SIZE}")

    key = jax.random.key(0)
    state = create_state(key)
    batches = [make_gpt_batch(jax.random.fold_in(key, 1 + i), BATCH_SIZE, CONFIG)
               for i in range(NUM_STEPS)]
    # The parallel step donates its state, so the reference run gets its own copy on device 0.
    ref_state = jax.device_put(jax.tree_util.tree_map(np.array, state), devices[0])

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    # verbose=True: a line per planning phase with its time (a live bar on a terminal)
    parallel_step = autopar.parallelize(train_step, mesh=mesh, batch_argnums=(1,),
                                        donate_argnums=(0,), verbose=True)

    t0 = time.perf_counter()
    plan = parallel_step.get_plan(state, batches[0])
    print(f"\nplanned in {time.perf_counter() - t0:.2f} s\n")
    print(short_dump(plan))
    print("\n(mesh axis names are only labels: the ILP decides what each axis splits, the batch, "
          "the weights or both, from the axis sizes and link costs)")
    report = os.path.abspath("plan.html")
    autopar.report(plan, report)
    print(f"\nthe plan as a page (mesh, memory, collectives, why this plan): {report}")

    print(f"\n== training {NUM_STEPS} steps with autopar on mesh "
          f"{dict(zip(mesh.axis_names, mesh.devices.shape))} ==")
    t0 = time.perf_counter()
    par_losses = []
    for i, batch in enumerate(batches):
        state, loss = parallel_step(state, batch)
        par_losses.append(float(loss))
        print(f"step {i:2d}  loss {par_losses[-1]:.6f}")
    print(f"autopar: {NUM_STEPS} steps in {time.perf_counter() - t0:.2f} s (incl. compile)")

    kernel = state.params["params"]["block_0"]["mlp"]["fc"]["kernel"]
    print(f"\nwhere the outputs live: params/block_0/mlp/fc/kernel {kernel.shape} is "
          f"{kernel.sharding.spec} on {len(kernel.sharding.device_set)} devices; "
          f"loss is {loss.sharding.spec}")

    print(f"\n== reference: plain jax.jit on {devices[0]} ==")
    single_step = jax.jit(train_step, donate_argnums=(0,))
    t0 = time.perf_counter()
    ref_losses = []
    for batch in batches:
        ref_state, loss = single_step(ref_state, jax.device_put(batch, devices[0]))
        ref_losses.append(float(loss))
    print(f"jax.jit: {NUM_STEPS} steps in {time.perf_counter() - t0:.2f} s (incl. compile)")

    print(f"\n{'step':>4}  {'autopar':>12}  {'jax.jit (1 device)':>18}  {'rel. diff':>9}")
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(par_losses, ref_losses)]
    for i, (a, b, r) in enumerate(zip(par_losses, ref_losses, rel)):
        print(f"{i:>4}  {a:>12.6f}  {b:>18.6f}  {r:>9.1e}")
    worst = max(rel)
    print(f"\ntotal run time {time.perf_counter() - t_start:.1f} s")
    if worst > TOLERANCE:
        print(f"MISMATCH: autopar differs from single-device training: max relative loss "
              f"difference {worst:.1e} > {TOLERANCE:.0e}")
        return 1
    print(f"autopar matches single-device training: max relative loss difference {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
