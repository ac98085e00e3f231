"""Tests for autopar.plan_cache: keys (every input changes the key; the same inputs give the
same key in another process), hits and misses, bad entries (warned about, moved aside,
rebuilt), concurrent writers, and unwritable directories."""
from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import queue as queue_module
import time

import pytest

import autopar
from autopar.core.errors import InvalidArgumentError
from autopar.core.plan import ParallelPlan
from autopar.tools import plan_cache
from autopar.tools.plan_cache import (
    PlanCache,
    cache_key,
    canonical_text,
    default_cache_dir,
    env_setting,
)

CLUSTER = autopar.ClusterSpec.preset("dgx-a100", num_hosts=2)
METHOD = autopar.PipeshardParallel(
    num_microbatches=2, layer_option=autopar.AutoLayerOption(num_layers=2),
    stage_option=autopar.UniformStageOption(num_stages=2),
    sharding_rules=((r"\['fc'\]", (None, "model")),))
KEY_INPUTS = dict(graph_fingerprint="0123456789abcdef", args_signature="f32[8,8] f32[8,8]",
                  cluster=CLUSTER, method=METHOD, mesh_shape=(2, 8),
                  axis_names=("data", "model"), device_ids=tuple(range(16)))
LOGGER = "autopar.tools.plan_cache"


@pytest.fixture(scope="module")
def plan():
    import optax

    from support.steps import make_case
    step, state, batches = make_case("mlp", "linen", optax.sgd(0.1), batch_size=8, hidden=8)
    return autopar.plan(step, state, batches[0], cluster=autopar.ClusterSpec.preset("cpu"))


@pytest.fixture
def cache(tmp_path):
    return PlanCache(tmp_path / "plans")


def _key(**changes):
    return cache_key(**{**KEY_INPUTS, **changes})


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno >= logging.WARNING]


# -- keys ------------------------------------------------------------------------------------

def test_same_inputs_give_the_same_key():
    same = dict(KEY_INPUTS, cluster=autopar.ClusterSpec.preset("dgx-a100", num_hosts=2),
                mesh_shape=[2, 8], axis_names=["data", "model"], device_ids=range(16))
    key = _key()
    assert cache_key(**same) == key
    assert len(key) == 64 and int(key, 16) >= 0


KEY_CHANGES = {
    "graph fingerprint": dict(graph_fingerprint="0123456789abcdee"),
    "args signature": dict(args_signature="f32[16,8] f32[16,8]"),
    "extra": dict(extra="donate=(0,)"),
    "cluster memory": dict(cluster=CLUSTER.with_(memory_bytes=CLUSTER.memory_bytes // 2)),
    "cluster float field": dict(cluster=CLUSTER.with_(
        intra_host_alpha_s=CLUSTER.intra_host_alpha_s * (1 + 1e-12))),
    "cluster name": dict(cluster=CLUSTER.with_(name="other")),
    "cluster hosts": dict(cluster=CLUSTER.with_(num_hosts=1)),
    "method class": dict(method=autopar.ShardParallel()),
    "method option": dict(method=dataclasses.replace(METHOD, num_microbatches=4)),
    "method enum": dict(method=dataclasses.replace(METHOD, schedule=autopar.Schedule.GPIPE)),
    "method nested option": dict(method=dataclasses.replace(
        METHOD, stage_option=autopar.UniformStageOption(num_stages=4))),
    "method rules": dict(method=dataclasses.replace(METHOD, sharding_rules=())),
    "mesh shape": dict(mesh_shape=(4, 4)),
    "axis names": dict(axis_names=("model", "data")),
    "device ids": dict(device_ids=tuple(reversed(range(16)))),
}


@pytest.mark.parametrize("change", sorted(KEY_CHANGES))
def test_every_input_changes_the_key(change, cache, plan):
    cache.put(_key(), plan)
    changed = _key(**KEY_CHANGES[change])
    assert changed != _key()
    assert cache.get(changed) is None
    assert cache.get(_key()) == plan


@pytest.mark.parametrize("package", ["autopar", "jax", "jaxlib", "cache format"])
def test_versions_change_the_key(package, monkeypatch, cache, plan):
    cache.put(_key(), plan)
    before = _key()
    if package == "cache format":
        monkeypatch.setattr(plan_cache, "VERSION", plan_cache.VERSION + 1)
    else:
        real = plan_cache._package_version
        monkeypatch.setattr(plan_cache, "_package_version",
                            lambda name: "999.0" if name == package else real(name))
    assert _key() != before
    assert cache.get(_key()) is None


# Values whose naive text depends on the process: a set's order follows the string hash seed.
SEEDED = {"names": frozenset(f"axis{i}" for i in range(32)), "schedule": autopar.Schedule.GPIPE,
          "tol": 0.1}


def _key_in_child() -> tuple[str, str]:
    return _key(), canonical_text(SEEDED)


def test_key_is_the_same_in_another_process():
    # A spawned interpreter has its own hash seed and addresses: an id- or hash-based text
    # anywhere in the key would differ.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_key_in_child) == (_key(), canonical_text(SEEDED))


def test_canonical_text_names_fields_and_rejects_unstable_values():
    assert canonical_text(autopar.AutoLayerOption(num_layers=2)) == \
        "AutoLayerOption(num_layers=2,imbalance=0.25)"
    assert canonical_text(autopar.Schedule.GPIPE) == "Schedule.GPIPE"
    assert canonical_text({"b": 1, "a": frozenset({2, 1})}) == "{'a':set(1,2),'b':1}"
    with pytest.raises(InvalidArgumentError, match="object.*plan_cache=None"):
        cache_key(**{**KEY_INPUTS, "method": object()})


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "mine"
    assert PlanCache().directory == tmp_path / "mine"
    monkeypatch.delenv("AUTOPAR_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "autopar" / "plans"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "autopar" / "plans"


# -- hits and misses -------------------------------------------------------------------------

@pytest.mark.parametrize("value, want", [
    (None, ("", False)), ("", ("", False)), ("off", ("off", True)), ("No", ("No", True)),
    ("0", ("0", True)), ("FALSE", ("FALSE", True)), ("/tmp/plans", ("/tmp/plans", False)),
])
def test_env_setting(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("AUTOPAR_PLAN_CACHE", raising=False)
    else:
        monkeypatch.setenv("AUTOPAR_PLAN_CACHE", value)
    assert env_setting() == want


def test_put_then_get_is_a_hit(cache, plan, caplog):
    caplog.set_level(logging.DEBUG, LOGGER)
    key = _key()
    assert cache.get(key) is None
    assert "miss" in caplog.text
    path = cache.put(key, plan)
    assert path == cache.directory / f"plan-{key}.json" and path.is_file()
    got = cache.get(key)
    assert isinstance(got, ParallelPlan) and got == plan
    assert "hit" in caplog.text and not _warnings(caplog)
    header = json.loads(path.read_text())
    assert header["format"] == plan_cache.FORMAT and header["version"] == plan_cache.VERSION
    assert header["key"] == key and header["created_utc"].endswith("+00:00")
    assert {k: header[k] for k in ("autopar", "autopar_source", "jax", "jaxlib")} == \
        plan_cache.library_versions()
    assert cache.entries() == {key: path}
    assert not [p for p in cache.directory.iterdir() if p != path]   # no temporary files left


def test_put_overwrites(cache, plan):
    other = dataclasses.replace(plan, timings_s={"cache": "test"})
    cache.put(_key(), plan)
    cache.put(_key(), other)
    assert cache.get(_key()) == other


def test_bad_keys_and_values_raise(cache, plan):
    for key in ("../escape", "", "a.b", "x" * 129, None):
        with pytest.raises(InvalidArgumentError, match="plan cache key"):
            cache.get(key)
    with pytest.raises(InvalidArgumentError, match="ParallelPlan"):
        cache.put(_key(), plan.to_json())


def test_entries_and_clear_touch_only_cache_files(cache, plan):
    a, b = _key(), _key(extra="b")
    cache.put(a, plan)
    cache.put(b, plan)
    d = cache.directory
    (d / f"plan-{a}.json.bad").write_text("old")
    (d / f".plan-{a}.x1y2.tmp").write_text("partial")
    foreign = [d / "cpu-1x8-v2.json", d / "notes.txt", d / "plan-.json"]
    for f in foreign:
        f.write_text("keep")
    assert list(cache.entries()) == sorted([a, b])
    assert cache.clear() == 4
    assert cache.entries() == {} and cache.get(a) is None
    assert sorted(d.iterdir()) == sorted(foreign)
    assert PlanCache(d / "missing").clear() == 0


def test_describe_reads_each_entry_without_touching_it(cache, plan):
    searched = dataclasses.replace(plan, searched_at="2026-01-02T03:04:05+00:00")
    good, stale, junk, aside = _key(), _key(extra="stale"), _key(extra="junk"), _key(extra="x")
    cache.put(good, searched)
    path = cache.put(stale, searched)
    d = json.loads(path.read_text())
    d["jax"] = "0.0.1"
    path.write_text(json.dumps(d))
    cache.path(junk).write_text("{")
    (cache.directory / f"plan-{aside}.json.bad").write_text("old")
    (cache.directory / "notes.txt").write_text("not ours")
    before = sorted(p.name for p in cache.directory.iterdir())
    infos = {e.key: e for e in cache.describe()}
    assert sorted(p.name for p in cache.directory.iterdir()) == before      # nothing moved
    assert set(infos) == {good, stale, junk, aside}
    g = infos[good]
    assert (g.method, g.mesh, g.cluster, g.searched_at, g.problem) == (
        plan.method, "data=1 x model=8", plan.cluster, "2026-01-02T03:04:05+00:00", "")
    assert g.size_bytes == cache.path(good).stat().st_size and g.created_utc
    assert dict(g.versions) == plan_cache.library_versions()
    assert "written by another version: jax '0.0.1'" in infos[stale].problem
    assert infos[stale].method == plan.method                  # still read for the listing
    assert "not valid JSON" in infos[junk].problem and infos[junk].method == ""
    assert infos[aside].problem.startswith("moved aside")
    assert PlanCache(cache.directory / "missing").describe() == []


# -- bad entries -----------------------------------------------------------------------------

def _entry_text(cache, key, plan):
    cache.put(key, plan)
    return cache.path(key).read_text()


def _edit(change):
    """A corruption that edits the entry's JSON: `change(entry_dict)`."""
    def corrupt(text, other):
        d = json.loads(text)
        change(d)
        return json.dumps(d)
    return corrupt


BAD_ENTRIES = {
    "truncated": (lambda text, other: text[:len(text) // 2], "not valid JSON"),
    "empty": (lambda text, other: "", "empty"),
    "garbage bytes": (lambda text, other: b"\x00\xff\xfe garbage \x80", "not valid JSON"),
    "a JSON list": (lambda text, other: "[1, 2, 3]", "not a plan cache entry"),
    "another key": (lambda text, other: other, "holds key"),
    "future format": (_edit(lambda d: d.update(version=plan_cache.VERSION + 1)),
                      "cache format version"),
    "foreign format": (_edit(lambda d: d.update(format="something")), "not a plan cache entry"),
    "old plan format": (_edit(lambda d: d["plan"].update(version=99)), "PlanMismatchError"),
    "plan missing fields": (_edit(lambda d: d["plan"].pop("graph_fingerprint")),
                            "does not load"),
    "no plan": (_edit(lambda d: d.pop("plan")), "does not load"),
}


@pytest.mark.parametrize("kind", sorted(BAD_ENTRIES))
def test_bad_entry_warns_moves_aside_and_is_rebuilt(kind, cache, plan, caplog):
    corrupt, reason = BAD_ENTRIES[kind]
    key = _key()
    text = _entry_text(cache, key, plan)
    other = _entry_text(cache, _key(extra="other"), plan)
    bad = corrupt(text, other)
    path = cache.path(key)
    path.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    assert cache.get(key) is None
    (message,) = _warnings(caplog)
    assert str(path) in message and "ignored; it will be rebuilt" in message
    assert reason in message
    assert not path.exists() and path.with_name(path.name + ".bad").exists()
    assert cache.get(key) is None and len(_warnings(caplog)) == 1     # now a plain miss
    cache.put(key, plan)
    assert cache.get(key) == plan


def test_entry_from_other_library_version_is_rebuilt(monkeypatch, cache, plan, caplog):
    key = _key()
    real = plan_cache._package_version
    with monkeypatch.context() as m:
        m.setattr(plan_cache, "_package_version",
                  lambda name: "0.0.1" if name == "jax" else real(name))
        cache.put(key, plan)
        assert cache.get(key) == plan
    assert cache.get(key) is None
    (message,) = _warnings(caplog)
    assert "jax '0.0.1'" in message and str(cache.path(key)) in message


def test_bad_entry_replaced_meanwhile_is_not_moved_aside(monkeypatch, cache, plan, caplog):
    # A reader that read a bad file must not move aside the good one a writer put since.
    key = _key()
    cache.put(key, plan)
    cache.path(key).write_text("not json")
    real_decode = plan_cache._decode

    def decode_while_a_writer_replaces(data, k):
        PlanCache(cache.directory).put(k, plan)
        return real_decode(data, k)
    monkeypatch.setattr(plan_cache, "_decode", decode_while_a_writer_replaces)
    assert cache.get(key) is None
    assert len(_warnings(caplog)) == 1
    monkeypatch.setattr(plan_cache, "_decode", real_decode)
    assert cache.get(key) == plan
    assert not cache.path(key).with_name(cache.path(key).name + ".bad").exists()


# -- unwritable directories and failed writes ------------------------------------------------

def test_unwritable_directory_warns_once(tmp_path, plan, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = PlanCache(blocker / "plans")
    assert cache.put(_key(), plan) is None
    assert cache.put(_key(), plan) is None
    (message,) = _warnings(caplog)
    assert str(blocker / "plans") in message and "AUTOPAR_CACHE_DIR" in message
    assert cache.get(_key()) is None and cache.entries() == {}
    assert len(_warnings(caplog)) == 1


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="needs POSIX permissions that apply (not root)")
def test_read_only_directory_warns(tmp_path, plan, caplog):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        assert PlanCache(d).put(_key(), plan) is None
        assert len(_warnings(caplog)) == 1
    finally:
        d.chmod(0o700)


def test_failed_replace_leaves_no_temporary_file(monkeypatch, cache, plan, caplog):
    def fail(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(plan_cache.os, "replace", fail)
    assert cache.put(_key(), plan) is None
    assert "No space left" in _warnings(caplog)[0]
    assert list(cache.directory.iterdir()) == []


def test_unserializable_plan_is_not_cached(cache, plan, caplog):
    bad = dataclasses.replace(plan, timings_s={"when": object()})
    assert cache.put(_key(), bad) is None
    assert "cannot be written as JSON" in _warnings(caplog)[0]
    assert cache.get(_key()) is None and not cache.directory.exists()


# -- concurrency -----------------------------------------------------------------------------

PAD = 50_000      # bytes of padding per writer index: entries of 50-150 KB
READS = 60


def _writer(directory, key, plan_text, ready, done):
    cache = PlanCache(directory)
    plan = ParallelPlan.from_json(plan_text)
    ready.wait(60)
    rounds = 0
    while not done.is_set() or rounds < 5:       # until the reader has read enough
        assert cache.put(key, plan) is not None
        rounds += 1


def _reader(directory, key, ready, done, results):
    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    logging.getLogger(LOGGER).addHandler(Collect())
    cache = PlanCache(directory)
    ready.wait(60)
    reads = []
    # READS reads at least; on a loaded machine the writers may not have replaced the first
    # entry yet after READS fast reads, so go on (up to a minute) until one has.
    deadline = time.monotonic() + 60
    while len(reads) < READS or (len(set(reads)) < 2 and time.monotonic() < deadline):
        got = cache.get(key)
        if got is None:
            reads.append(None)
        else:
            writer = got.measured["writer"]
            reads.append(writer if len(got.measured["pad"]) == PAD * (writer + 1) else "bad")
    done.set()
    results.put((reads, warnings))


def test_concurrent_writers_leave_a_complete_entry(tmp_path, plan):
    ctx = multiprocessing.get_context("spawn")
    directory, key, writers = tmp_path / "plans", _key(), 3
    plans = [dataclasses.replace(plan, measured={"writer": i, "pad": "x" * (PAD * (i + 1))})
             for i in range(writers)]
    PlanCache(directory).put(key, plans[0])
    ready, done, results = ctx.Barrier(writers + 1), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(directory, key, p.to_json(), ready, done))
             for p in plans]
    procs.append(ctx.Process(target=_reader, args=(directory, key, ready, done, results)))
    for p in procs:
        p.start()
    try:
        reads, warnings = results.get(timeout=120)
    except queue_module.Empty:
        reads, warnings = None, None
    done.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * (writers + 1)
    assert reads is not None, "the reader process did not report"
    # The entry always exists (put before the writers start) and is only ever replaced whole.
    assert warnings == [] and "bad" not in reads and None not in reads
    assert len(reads) >= READS and set(reads) <= set(range(writers))
    assert len(set(reads)) > 1, "the reader saw no writer's entry replace another's"
    final = PlanCache(directory).get(key)
    assert final in plans
    assert sorted(p.name for p in directory.iterdir()) == [f"plan-{key}.json"]


@pytest.mark.parametrize("pipeline", [False, True])
def test_parallelize_reuses_a_cached_plan(tmp_path, pipeline):
    """A second decorated step with the same function, shapes, mesh and method reads the
    plan from disk (no search), says so in the plan and the dump, and computes the same."""
    from support.steps import make_case, mesh_of, sgd_momentum_clip
    method = (autopar.PipeshardParallel(num_microbatches=2,
                                        layer_option=autopar.AutoLayerOption(num_layers=2),
                                        stage_option=autopar.UniformStageOption(num_stages=2))
              if pipeline else autopar.ShardParallel())
    step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(),
                                     value_and_grad=autopar.value_and_grad)
    first = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method,
                                plan_cache=tmp_path)
    second = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method,
                                 plan_cache=tmp_path)
    p1, p2 = first.get_plan(state, batches[0]), second.get_plan(state, batches[0])
    assert p1.origin == "search" and p2.origin == "plan cache"
    assert "plan from: plan cache" in autopar.dump(p2)
    assert [s.device_ids for s in p1.stages] == [s.device_ids for s in p2.stages]
    assert p1.inputs == p2.inputs
    if pipeline:        # the cached stage solutions are replayed: no stage ILP is solved
        assert p1.pipeline["num_ilps"] > 0
        assert p2.pipeline["num_replayed"] == 2     # the search record is kept (issue 16):
        assert p2.pipeline["num_ilps"] == p1.pipeline["num_ilps"]
        assert p2.searched_at == p1.searched_at
    assert len(PlanCache(tmp_path).entries()) == 1
    assert float(first(state, batches[0])[1]) == float(second(state, batches[0])[1])
    off = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method, plan_cache=False)
    assert off.get_plan(state, batches[0]).origin == "search"


def test_a_change_to_autopar_source_is_a_miss(monkeypatch):
    """The key includes a digest of autopar's source: a plan made by other code (a new cost or
    memory model in a checkout) is not reused."""
    args = dict(graph_fingerprint="f", args_signature="s", cluster="c", method="m",
                mesh_shape=(2, 4), axis_names=("data", "model"), device_ids=tuple(range(8)))
    before = plan_cache.cache_key(**args)
    assert len(plan_cache.source_digest()) == 16
    monkeypatch.setattr(plan_cache, "source_digest", lambda: "0" * 16)
    assert plan_cache.cache_key(**args) != before
