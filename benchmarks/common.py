"""Helpers shared by the benchmark scripts of this folder.

The scripts are run as `python benchmarks/<script>.py`, so this folder is the first entry of
`sys.path` and they import this module as `common`. Nothing here imports jax at module level:
the drivers do not need it, and each worker sets its environment before importing it.

Each benchmark writes its whole report to `benchmarks/results/<key>.md` (`result_path`,
`write_result`); `BENCHMARKS.md` at the repository root is the index of those files, with one
headline per benchmark, kept by hand.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
INDEX = os.path.join(REPO, "BENCHMARKS.md")

# The measured steps of both benchmarks run on 8 simulated CPU devices, a 2 x 4 mesh.
MESH_SHAPE, AXIS_NAMES = (2, 4), ("data", "model")
NUM_DEVICES = MESH_SHAPE[0] * MESH_SHAPE[1]


def progress(tag: str, msg: str) -> None:
    stamp = _dt.datetime.now().strftime("%H:%M:%S")
    print(f"[{tag} {stamp}] {msg}", file=sys.stderr, flush=True)


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M")


# ---------------------------------------------------------------------------------------------
# The machine and the source.
# ---------------------------------------------------------------------------------------------

def load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def source_revision() -> str:
    """The checked-out commit (read-only git calls), marked if autopar/models/benchmarks differ
    from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "autopar", "models",
                                "benchmarks"], cwd=REPO, text=True, capture_output=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" +uncommitted changes" if dirty else "")


def jax_info(results) -> dict | None:
    """The `jax` entry (version, platform, device count) of the first result that has one."""
    return next((r["jax"] for r in results if "jax" in r), None)


def revision_text(start: str | None, end: str | None) -> str:
    """The source revisions read at the start and the end of a run, for the report."""
    if start is None:
        return "not recorded"
    return start if start == end else (f"{start} at the start, {end} at the end: the source "
                                       "changed during the run")


# ---------------------------------------------------------------------------------------------
# The results files: benchmarks/results/<key>.md, one per benchmark, each rewritten whole.
# ---------------------------------------------------------------------------------------------

RESULT_KEYS = ("shard_parallel", "pipeline", "multihost", "methods", "fidelity", "paper",
               "loops", "real_world", "ilp", "plan_workers", "gpt39b", "memory", "runner_ups",
               "gpu", "shared_copies", "budget_plan", "accumulation", "schedules",
               "schedule_search")
# "shard_parallel" is run_all.py's own report; "gpt39b" (GPT-39B planning time) is written by
# hand from benchmarks/paper.py runs, no script rewrites it.


def result_path(key: str) -> str:
    """Where the benchmark `key` writes its report by default: benchmarks/results/<key>.md."""
    return os.path.join(RESULTS_DIR, f"{key}.md")


def run_worker(script: str, argv: list[str], timeout_s: float) -> dict:
    """Run `script --_worker ROWS *argv` (a child that writes its result rows as JSON to the
    file ROWS) with this Python, plan cache off. Returns {"started", "revision", "cpu",
    "rows", "finished", "load"} and "error" when the child failed or ran out of time (the
    rows it wrote are kept)."""
    res = {"started": utc_now(), "revision": source_revision(), "cpu": cpu_model()}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        env = {**os.environ, "PYTHONPATH": REPO, "AUTOPAR_PLAN_CACHE": "off"}
        try:
            r = subprocess.run([sys.executable, os.path.abspath(script), "--_worker", out,
                                *argv], env=env, cwd=REPO, timeout=timeout_s)
            if r.returncode:
                res["error"] = f"worker exited with status {r.returncode}"
        except subprocess.TimeoutExpired:
            res["error"] = f"worker stopped after {timeout_s:.0f} s"
        res["rows"] = json.load(open(out)) if os.path.exists(out) else []
    res["finished"], res["load"] = utc_now(), load_avg()
    return res


COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")


def collective_kinds(found: dict, *, kib: bool = True) -> str:
    """`hlo.summary`-like {kind: (count, bytes)} as text: "all-reduce 3 (12 KiB), ..."."""
    parts = [f"{k} {n}" + (f" ({b / 1024:.0f} KiB)" if kib else "")
             for k in COLLECTIVE_KINDS if k in found for n, b in [found[k]]]
    return ", ".join(parts) or "none"


def section_head(title: str, res: dict, cmdline: str) -> list[str]:
    """The first lines of a report that a `run_worker` result fills: its title and the command
    with when, where and on which revision it ran."""
    return [f"## {title}", "",
            f"Command: `{cmdline}`; {res['started']} to {res['finished']}, revision "
            f"{res['revision']}, {res['cpu']}, load average at the end {res['load']}.", ""]


def section_tail(out: list[str], res: dict) -> str:
    """The report's lines joined, with a line saying the worker did not finish (if it did
    not): the counterpart of `section_head`."""
    if res.get("error"):
        out = out + ["", f"The worker did not finish: {res['error']}."]
    return "\n".join(out)


def results(args, run) -> dict:
    """A script's results: read from `--from-json` (re-rendering saved results), else
    `run(args)`."""
    if args.from_json:
        with open(args.from_json) as f:
            return json.load(f)
    return run(args)


def write_result(text: str, path: str) -> None:
    """Write a benchmark's report to `path` (its results file), replacing what was there."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


# ---------------------------------------------------------------------------------------------
# Child processes: each case runs in its own, which saves its results after every phase.
# ---------------------------------------------------------------------------------------------

class Saver:
    """A result dict written to disk after every phase, so a killed child leaves what it had."""

    def __init__(self, path: str):
        self.path, self.data = path, {}

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def run_child(script: str, argv: list[str], prefix: str, timeout_s: float,
              limit_name: str) -> tuple[dict | None, str | None, float]:
    """Run `script argv --_result PATH` with this Python and wait at most `timeout_s`.

    Returns (the results the child saved or None, what went wrong or None, wall seconds)."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".json")
    os.close(fd)
    os.unlink(path)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, script, *argv, "--_result", path], cwd=REPO)
    outcome = None
    try:
        rc = proc.wait(timeout=timeout_s)
        if rc != 0:
            outcome = f"worker exited with status {rc}" + (
                " (killed by the OS: out of memory?)" if rc in (-9, 137) else "")
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        outcome = f"stopped after the {limit_name} of {timeout_s:.0f} s"
    result = None
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        os.unlink(path)
    return result, outcome, time.perf_counter() - t0


def run_case(script: str, argv: list[str], label: str, timeout_s: float, prefix: str,
             report) -> dict:
    """`run_child` for one case of a benchmark, with progress through `report(msg)`: the
    results the child saved (or {}), plus `incomplete` (what stopped it) and
    `process_wall_s`."""
    report(f"{label}: starting worker")
    result, outcome, wall_s = run_child(script, argv, prefix, timeout_s, "per-case limit")
    result = result or {}
    if outcome:
        result["incomplete"] = outcome
    result["process_wall_s"] = wall_s
    report(f"{label}: done in {wall_s:.1f} s" + (f" ({outcome})" if outcome else ""))
    return result


def setup_worker(num_devices: int | None = None) -> None:
    """Environment of a worker, before it imports jax: CPU platform (`num_devices` simulated
    devices if given) and the repository on `sys.path` (for `models`)."""
    if num_devices:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={num_devices}"
                                   ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, REPO)


# ---------------------------------------------------------------------------------------------
# The GPT training step and state (import jax lazily: call these in a worker only).
# ---------------------------------------------------------------------------------------------

def gpt_train_step(gpt_loss, value_and_grad):
    """`train_step(state, batch) -> (state, loss)` for a GPT `TrainState`; `value_and_grad` is
    `jax.value_and_grad` or `autopar.value_and_grad`."""
    def train_step(state, batch):
        def loss_fn(params):
            return gpt_loss(state.apply_fn(params, batch["tokens"]), batch["tokens"])
        loss, grads = value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
    return train_step


def gpt_state_fn(model, tx, seq_len: int):
    """`create_state(key) -> TrainState` of `model` (a GPT) with optimizer `tx`."""
    import jax.numpy as jnp
    from flax.training import train_state

    def create_state(key):
        params = model.init(key, jnp.zeros((1, seq_len), jnp.int32))
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return create_state


# ---------------------------------------------------------------------------------------------
# Markdown numbers.
# ---------------------------------------------------------------------------------------------

def fmt(x, digits=2, scale=1.0) -> str:
    if x is None:
        return "–"
    if isinstance(x, (int, float)):
        return f"{x * scale:,.{digits}f}"
    return str(x)


def ms(x, digits=1) -> str:
    """Seconds as milliseconds."""
    return "–" if x is None else f"{x * 1e3:,.{digits}f}"


def md_row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def section_main(argv, *, doc: str, key: str, script: str, worker, run, section) -> int:
    """The command line of a benchmark script with one worker (`--out`, and the internal
    `--_worker ROWS` its `run` starts): run it, write its report to `--out` (by default
    benchmarks/results/<key>.md), print it."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    default = result_path(key)
    ap.add_argument("--out", default=default,
                    help=f"the Markdown file to write (default: benchmarks/results/{key}.md)")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        worker(args._worker)
        return 0
    text = section(run(), f"python benchmarks/{script}" + (
        f" --out {args.out}" if args.out != default else ""))
    write_result(text, args.out)
    print(text)
    return 0
