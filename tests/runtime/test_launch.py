"""`python -m autopar launch` end to end: 2 processes x 4 simulated CPU devices on 127.0.0.1
form one job. GPT under ShardParallel and Zero3Parallel (sharded across both processes) and
under 2-stage 1F1B and GPipe pipelines whose stages sit on different processes, and under
gradient accumulation (one executable across both processes), equals plain `jax.jit` on one
device
(the tolerances of the single-process equivalence tests); the checkpoint both processes wrote
restores into this single 8-device process (a new device count and mesh) and trains on
identically; a killed process stops the other within the bound, with an error naming it; a
process whose peer never joins stops with a clear error."""
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import autopar
from autopar.runtime import distributed as dist
from autopar.runtime.launch import _describe, main
from support import REPO
from support.steps import make_case, mesh_of, run_steps, sgd_momentum_clip

ROOT = REPO
WORKER = os.path.join(ROOT, "tests", "support", "mp_worker.py")
HEARTBEAT_S = 5


def _launch(out, mode, timeout_s=420):
    env = {**os.environ, "PYTHONPATH": ROOT, "AUTOPAR_PLAN_CACHE": "off"}
    cmd = [sys.executable, "-m", "autopar.runtime.launch", "--num-processes", "2",
           "--devices-per-process", "4", "--heartbeat-timeout", str(HEARTBEAT_S),
           "--timeout", str(timeout_s - 20), WORKER, str(out), mode]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def _train(tmp_path_factory, names):
    out = tmp_path_factory.mktemp("mp")
    r = _launch(out, "train:" + ",".join(names))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "all 2 processes finished" in r.stdout
    return out


def _reference():
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(),
                                     value_and_grad=autopar.value_and_grad)
    return step, state, batches, run_steps(jax.jit(step), state, batches)


def _check(npz, ref, rtol):
    ref_state, losses, grads = ref          # jax.jit's run_steps: state, losses, gradients
    for i, loss in enumerate(losses):
        assert abs(npz[f"loss_{i}"] - loss) <= rtol * abs(loss), f"step {i} loss"
        leaves = jax.tree_util.tree_leaves(grads[i])
        scale = max(float(np.max(np.abs(g))) for g in leaves)
        for j, g in enumerate(leaves):
            assert np.max(np.abs(npz[f"grad_{i}_{j}"] - g)) <= rtol * scale, f"grad {i},{j}"
    for j, p in enumerate(jax.tree_util.tree_leaves(ref_state.params)):
        p = np.asarray(p)
        assert np.max(np.abs(npz[f"param_{j}"] - p)) <= rtol * max(np.max(np.abs(p)), 1e-12)


def _check_run(out, name, rtol, ref):
    _check(np.load(out / f"{name}.npz"), ref, rtol)
    facts = json.loads((out / f"{name}.json").read_text())
    assert facts["restored_equal"]          # the 2-process checkpoint round trip
    assert facts["num_hosts"] == 2          # the cluster spec sees the process hierarchy
    if name in ("pipe", "gpipe"):           # each stage on its own process
        assert facts["processes"] == [[0], [1]]
    else:
        assert facts["processes"] == [[0, 1]]


def test_two_processes_match_one_device_and_resume_on_one(tmp_path_factory):
    """One mesh (ShardParallel) and a 1F1B pipeline trained by 2 processes equal jax.jit on
    one device. Elastic: the state both processes saved under ShardParallel (2 x 4 over 2
    hosts) restores onto a 1 x 8 plan in this one process and trains on exactly like the
    uninterrupted single-device run. (One test: a module fixture shared by two tests runs once
    per pytest-xdist worker, and this one is two 20-s processes.)"""
    trained = _train(tmp_path_factory, ("shard", "pipe"))
    step, state, batches, ref = _reference()
    _check_run(trained, "shard", 1e-5, ref)
    _check_run(trained, "pipe", 2e-5, ref)
    par = autopar.parallelize(step, mesh=mesh_of((1, 8)))
    target = par.input_shardings(state, batches[0])[0]
    restored = autopar.restore_checkpoint(str(trained / "ckpt_shard"), target)
    assert autopar.latest_step(str(trained / "ckpt_shard")) == 3
    for a, b in zip(jax.tree_util.tree_leaves(restored.params),
                    jax.tree_util.tree_leaves(ref[0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    _, got_loss, _ = par(restored, batches[0])
    _, want_loss, _ = jax.jit(step)(ref[0], batches[0])
    assert abs(float(got_loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))


@pytest.mark.slow
def test_two_processes_match_one_device_under_zero3_gpipe_and_accumulation(tmp_path_factory):
    """Zero3Parallel, a GPipe pipeline (the same mesh and stages again) and gradient
    accumulation over 4 microbatches (one executable across both processes)."""
    trained = _train(tmp_path_factory, ("zero3", "gpipe", "acc"))
    *_, ref = _reference()
    _check_run(trained, "zero3", 1e-5, ref)
    _check_run(trained, "gpipe", 2e-5, ref)
    _check_run(trained, "acc", 2e-5, ref)


def test_a_killed_process_stops_the_other_with_a_clear_error(tmp_path):
    r = _launch(tmp_path, "die", timeout_s=240)
    ended = time.time()
    text = r.stdout + r.stderr
    assert r.returncode != 0
    assert "process 1 failed first" in text and "killed by SIGKILL" in text
    # The survivor names the lost process: autopar's message, or JAX's abort naming task 1.
    assert ("process(es) [1] of the job" in text
            or ("heartbeat timeout" in text and "Task 1" in text)), text[-3000:]
    killed_at = float((tmp_path / "killed_at").read_text())
    assert ended - killed_at < HEARTBEAT_S + 30, f"took {ended - killed_at:.0f} s to stop"


def test_a_process_whose_peers_never_join_stops_with_a_clear_error():
    env = {**os.environ, "PYTHONPATH": ROOT, dist.ENV_COORDINATOR:
           f"127.0.0.1:{dist.free_port()}", dist.ENV_NUM_PROCESSES: "2",
           dist.ENV_PROCESS_ID: "0", dist.ENV_JOIN_TIMEOUT: "3",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", "import autopar; autopar.init_distributed()"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == dist.EXIT_JOIN_TIMEOUT, r.stderr[-2000:]
    assert "waited 3 s for all 2 processes to join" in r.stderr
    assert time.time() - t0 < 60


def test_launcher_arguments_and_status_text(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--num-processes", "2", str(tmp_path / "missing.py")])
    assert "does not exist" in capsys.readouterr().err
    assert _describe(-9) == "was killed by SIGKILL"
    assert "another process was lost" in _describe(dist.EXIT_PEER_LOST)
    assert _describe(3) == "exited with status 3"
