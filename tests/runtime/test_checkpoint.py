"""Checkpoints: a GPT TrainState saved from a 2x4 ShardParallel layout comes back with equal
values, dtypes and shardings, onto a 1x8 mesh, onto a 2-stage pipeline's submeshes (and
training continues there exactly as it would have without the save), onto a plan's layout;
latest-step selection and `keep`; clear errors; and a save killed mid-write leaves the previous
checkpoint as the latest, restorable one."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autopar
from autopar.lowering.single_mesh import plan_input_shardings
from autopar.models.gpt import megatron_rules
from autopar.runtime.checkpoint import all_steps, latest_step, restore_checkpoint, save_checkpoint
from support import REPO
from support.steps import make_case, mesh_of, run_steps, sgd_momentum_clip

TMP = ".orbax-checkpoint-tmp"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One ShardParallel step (Megatron-sharded, so leaves really are split) of a GPT
    TrainState on a 2x4 mesh (so momentum is non-zero), saved as checkpoint 1."""
    step, state, batches = make_case("gpt", "linen", sgd_momentum_clip(),
                                     value_and_grad=autopar.value_and_grad)
    method = autopar.ShardParallel(sharding_rules=megatron_rules())
    state1 = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method)(state, batches[0])[0]
    path = tmp_path_factory.mktemp("ckpt") / "run"
    assert save_checkpoint(path, state1, 1) == str(path / "1")
    return SimpleNamespace(step=step, state=state1, batches=batches, path=path)


@pytest.fixture(scope="module")
def on_1x8(saved):
    """A ShardParallel plan of the same step on a 1x8 mesh (planned, never compiled)."""
    par = autopar.parallelize(saved.step, mesh=mesh_of((1, 8)))
    return SimpleNamespace(shardings=par.input_shardings(saved.state, saved.batches[1])[0],
                           plan=par.get_plan(saved.state, saved.batches[1]))


def _assert_same(got, want, shardings):
    """Equal tree, values and dtypes; every leaf placed as `shardings` says."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for x, y, s in zip(*map(jax.tree_util.tree_leaves, (got, want, shardings))):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.sharding == s, (x.sharding, s)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _moves(state, shardings) -> int:
    """How many leaves the target places differently from where they were saved."""
    return sum(not s.is_equivalent_to(x.sharding, x.ndim) for x, s in
               zip(*map(jax.tree_util.tree_leaves, (state, shardings))))


def test_round_trip_keeps_values_dtypes_and_shardings(saved):
    leaves = jax.tree_util.tree_leaves(saved.state)
    assert any(not x.sharding.is_fully_replicated for x in leaves)   # really sharded
    assert any(np.any(np.asarray(x) != 0) for x in
               jax.tree_util.tree_leaves(saved.state.opt_state))     # momentum was trained
    shardings = jax.tree.map(lambda x: x.sharding, saved.state)
    _assert_same(restore_checkpoint(saved.path, saved.state), saved.state, shardings)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            saved.state)
    _assert_same(restore_checkpoint(saved.path, abstract, step=1), saved.state, shardings)


def test_restore_onto_a_1x8_mesh(saved, on_1x8):
    assert _moves(saved.state, on_1x8.shardings) > 0
    got = restore_checkpoint(saved.path, on_1x8.shardings)
    _assert_same(got, saved.state, on_1x8.shardings)
    assert {len(x.sharding.mesh.devices.flat) for x in jax.tree_util.tree_leaves(got)} == {8}
    assert {x.sharding.mesh.devices.shape for x in jax.tree_util.tree_leaves(got)} == {(1, 8)}


def test_restore_onto_a_plan_with_like(saved, on_1x8):
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), saved.state)
    got = restore_checkpoint(saved.path, on_1x8.plan, like=like)
    n = len(jax.tree_util.tree_leaves(like))
    assert jax.tree_util.tree_leaves(on_1x8.shardings) == \
        list(plan_input_shardings(on_1x8.plan)[:n])
    _assert_same(got, saved.state, on_1x8.shardings)


def test_elastic_replan_onto_a_pipeline_continues_identically(saved):
    """Saved on 2x4 under ShardParallel; restored onto a 2-stage pipeline's two disjoint 4-device
    submeshes; two more steps there equal the same pipeline run from the in-memory state."""
    pipe = autopar.parallelize(saved.step, mesh=mesh_of((2, 4)), method=autopar.PipeshardParallel(
        num_microbatches=2, layer_option=autopar.AutoLayerOption(num_layers=2),
        stage_option=autopar.UniformStageOption(num_stages=2)))
    shardings = pipe.input_shardings(saved.state, saved.batches[1])[0]
    restored = restore_checkpoint(saved.path, shardings)
    _assert_same(restored, saved.state, shardings)
    device_sets = {frozenset(d.id for d in x.sharding.device_set)
                   for x in jax.tree_util.tree_leaves(restored)}
    assert device_sets == {frozenset(range(4)), frozenset(range(4, 8))}
    assert _moves(saved.state, shardings) > 0

    resumed = run_steps(pipe, restored, saved.batches[1:])
    uninterrupted = run_steps(pipe, saved.state, saved.batches[1:])
    for got, want in zip(resumed, uninterrupted):
        for x, y in zip(*map(jax.tree_util.tree_leaves, (got, want))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(resumed[0].step) == int(saved.state.step) + 2


def _small(value: float):
    s = NamedSharding(mesh_of((2, 4)), P("data", "model"))
    return {"w": jax.device_put(np.full((4, 8), value, np.float32), s),
            "n": jax.device_put(np.int32(value), NamedSharding(mesh_of((2, 4)), P()))}


def test_latest_step_all_steps_and_keep(tmp_path):
    path = tmp_path / "run"
    assert latest_step(path) is None and all_steps(path) == ()
    for step in (1, 2, 3):
        assert save_checkpoint(path, _small(step), step, keep=2) == str(path / str(step))
    assert all_steps(path) == (2, 3) and latest_step(path) == 3
    assert sorted(p.name for p in path.iterdir() if p.name.isdigit()) == ["2", "3"]
    target = jax.tree.map(lambda x: x.sharding, _small(0))
    assert np.asarray(restore_checkpoint(path, target)["w"])[0, 0] == 3.0
    assert int(restore_checkpoint(path, target, step=2)["n"]) == 2
    save_checkpoint(path, _small(10), 10)       # keep=None keeps everything
    assert all_steps(path) == (2, 3, 10)


def test_restore_errors_name_the_path_step_and_leaf(tmp_path):
    path = tmp_path / "run"
    target = jax.tree.map(lambda x: x.sharding, _small(0))
    with pytest.raises(autopar.InvalidArgumentError, match=r"no checkpoint directory .*run"):
        restore_checkpoint(path, target)
    path.mkdir()
    (path / "notes.txt").write_text("x")
    with pytest.raises(autopar.InvalidArgumentError, match=r"no committed checkpoint.*notes\.txt"):
        restore_checkpoint(path, target)
    save_checkpoint(path, _small(1), 1)
    save_checkpoint(path, _small(2), 2)
    with pytest.raises(autopar.InvalidArgumentError, match=r"no committed checkpoint 7 .*\[1, 2\]"):
        restore_checkpoint(path, target, step=7)
    with pytest.raises(autopar.InvalidArgumentError, match=r"Saved but not in target: n\b"):
        restore_checkpoint(path, {"w": target["w"]})
    with pytest.raises(autopar.InvalidArgumentError, match=r"In target but not saved: extra"):
        restore_checkpoint(path, {**target, "extra": target["w"]})
    bad = jax.ShapeDtypeStruct((4, 4), np.float32, sharding=target["w"])
    with pytest.raises(autopar.InvalidArgumentError, match=r"leaf w has shape \(4, 4\) but the "
                       r"saved array has shape \(4, 8\)"):
        restore_checkpoint(path, {**target, "w": bad})
    bad = jax.ShapeDtypeStruct((4, 8), np.int32, sharding=target["w"])
    with pytest.raises(autopar.InvalidArgumentError, match=r"leaf w has dtype int32 .* float32"):
        restore_checkpoint(path, {**target, "w": bad})
    with pytest.raises(autopar.InvalidArgumentError, match=r"leaf w is a ShapeDtypeStruct "
                       r"without a sharding"):
        restore_checkpoint(path, {**target, "w": jax.ShapeDtypeStruct((4, 8), np.float32)})
    with pytest.raises(autopar.InvalidArgumentError, match=r"leaf w is a ndarray"):
        restore_checkpoint(path, {**target, "w": np.zeros((4, 8), np.float32)})
    three = NamedSharding(mesh_of((2, 4)), P("data", "model", None))
    with pytest.raises(autopar.InvalidArgumentError, match=r"cannot hold the saved shape"):
        restore_checkpoint(path, {**target, "w": three})
    with pytest.raises(autopar.InvalidArgumentError, match=r"step=-1"):
        restore_checkpoint(path, target, step=-1)
    with pytest.raises(autopar.InvalidArgumentError, match=r"only when target is a ParallelPlan"):
        restore_checkpoint(path, target, like=target)


def test_save_errors(tmp_path):
    path = tmp_path / "run"
    save_checkpoint(path, _small(5), 5)
    for step in (5, 3):     # orbax would skip these silently
        with pytest.raises(autopar.InvalidArgumentError, match=rf"step={step} is not after the "
                           r"latest checkpoint 5 .*greater than 5"):
            save_checkpoint(path, _small(step), step)
    with pytest.raises(autopar.InvalidArgumentError, match=r"keep=0"):
        save_checkpoint(path, _small(6), 6, keep=0)
    with pytest.raises(autopar.InvalidArgumentError, match=r"step=True"):
        save_checkpoint(path, _small(6), True)
    with pytest.raises(autopar.InvalidArgumentError, match=r"no array leaves"):
        save_checkpoint(path, {"a": ()}, 6)
    assert all_steps(path) == (5,)


def test_plan_target_errors(saved, on_1x8):
    with pytest.raises(autopar.InvalidArgumentError, match=r"like= is missing"):
        restore_checkpoint(saved.path, on_1x8.plan)
    with pytest.raises(autopar.InvalidArgumentError, match=r"argnum=1.*input_shardings"):
        restore_checkpoint(saved.path, on_1x8.plan, like=saved.state, argnum=1)
    with pytest.raises(autopar.InvalidArgumentError, match=r"like= leaf w has shape \(4, 8\) but "
                       r"the plan's argument leaf 1 \(`state.params\['params'\]\['block_0'\]"
                       r"\['attn'\]\['out'\]\['bias'\]`\) has shape \(32,\)"):
        restore_checkpoint(saved.path, on_1x8.plan, like=_small(0))
    too_many = [saved.state, saved.state, saved.state]
    with pytest.raises(autopar.InvalidArgumentError, match=r"like= has \d+ leaves but"):
        restore_checkpoint(saved.path, on_1x8.plan, like=too_many)


_CHILD = textwrap.dedent("""
    import asyncio, sys
    import jax, jax.numpy as jnp, numpy as np
    import orbax.checkpoint as ocp
    from autopar.runtime.checkpoint import save_checkpoint
    path, n = sys.argv[1], int(sys.argv[2])
    s = jax.sharding.NamedSharding(jax.make_mesh((8,), ("d",)), jax.sharding.PartitionSpec("d"))
    save_checkpoint(path, {"x": jax.device_put(np.arange(64, dtype=np.float32), s)}, 1)
    big = jax.jit(lambda: jnp.arange(n, dtype=jnp.float32) * 0.5, out_shardings=s)()
    big.block_until_ready()
    # A guard against a slow parent only: the commit (the rename) waits, so the kill always
    # lands before it. The parent kills once 1 MiB of the 128 MiB array is in the temporary
    # directory, with the rest still being written.
    async def stalled_commit(self):
        await asyncio.sleep(600)
    ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = stalled_commit
    print("saving 2", flush=True)
    save_checkpoint(path, {"x": big}, 2)
    print("saved 2", flush=True)
""")


def _bytes_under(directory) -> int:
    """Bytes of the files under `directory` while a writer works in it (a lock file may go
    between the walk and the stat)."""
    total = 0
    for root, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except FileNotFoundError:
                pass
    return total


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """A child process commits checkpoint 1, then is SIGKILLed while writing checkpoint 2."""
    path = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    out_file, err_file = tmp_path / "child.out", tmp_path / "child.err"
    with open(out_file, "w") as out, open(err_file, "w") as err:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(32 * 2**20)],
                                 env=env, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while _bytes_under(path / f"2{TMP}") < 2**20:    # its array data is being written
            assert child.poll() is None, f"child exited early: {err_file.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "checkpoint 2 never started writing"
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    out = out_file.read_text()
    assert "saving 2" in out and "saved 2" not in out, (out, err_file.read_text()[-3000:])
    assert _bytes_under(path / f"2{TMP}") >= 2**20 and not (path / "2").exists()  # left over

    assert latest_step(path) == 1 and all_steps(path) == (1,)
    s = NamedSharding(mesh_of((2, 4)), P(("data", "model")))
    got = restore_checkpoint(path, {"x": s})["x"]
    np.testing.assert_array_equal(np.asarray(got), np.arange(64, dtype=np.float32))
    with pytest.raises(autopar.InvalidArgumentError, match=r"no committed checkpoint 2 .*\[1\]"):
        restore_checkpoint(path, {"x": s}, step=2)
    # The next save clears the leftover and commits.
    save_checkpoint(path, {"x": got + 1}, 2)
    assert all_steps(path) == (1, 2) and not (path / f"2{TMP}").exists()


def test_autopar_and_its_checkpoints_leave_the_users_logging_alone(tmp_path):
    """orbax's import runs absl's logging.basicConfig(); neither `import autopar` nor a save
    may leave that root handler behind (it would reformat the user's and autopar's logs)."""
    import subprocess
    import sys
    code = ("import logging, jax.numpy as jnp, autopar\n"
            "assert logging.root.handlers == [], logging.root.handlers\n"
            f"autopar.save_checkpoint({str(tmp_path)!r}, {{'w': jnp.ones(3)}}, step=1)\n"
            "assert logging.root.handlers == [], logging.root.handlers\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
