"""`python -m autopar.launch`: try a multi-host run on one machine.

Starts N processes on 127.0.0.1, each with K simulated CPU devices (CPU collectives through
gloo), joins them into one JAX job (`autopar.init_distributed`, called for the script) and
runs the same script in each, like one controller process per host. Their output is printed
with a `[process i]` prefix. If one process fails, the others stop within the heartbeat
time-out with an error that names it (they never hang), and the launcher exits with the first
failure's status.

    python -m autopar.launch --num-processes 2 --devices-per-process 4 examples/multihost_gpt.py

On a real cluster, run the script on every host instead and call `autopar.init_distributed()`
at its top (it reads SLURM and the other schedulers' variables, or `JAX_COORDINATOR_ADDRESS`).
"""
from __future__ import annotations

import argparse
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from . import distributed as dist
from .errors import InvalidArgumentError

_CHILD = "--_child"


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchResult:
    returncodes: tuple[int, ...]       # per process (negative: killed by that signal)
    first_failure: int | None          # the process that failed first, if any
    message: str                       # the launcher's summary line


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == dist.EXIT_PEER_LOST:
        return f"stopped because another process was lost (status {code})"
    if code == dist.EXIT_JOIN_TIMEOUT:
        return f"stopped because not every process joined in time (status {code})"
    return f"exited with status {code}"


def _child_env(i: int, n: int, devices: int, coordinator: str, heartbeat_s: float,
               join_s: float) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env.update({
        "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
        "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
        dist.ENV_COORDINATOR: coordinator, dist.ENV_NUM_PROCESSES: str(n),
        dist.ENV_PROCESS_ID: str(i), dist.ENV_TRANSFER: f"127.0.0.1:{dist.free_port()}",
        dist.ENV_HEARTBEAT: str(heartbeat_s), dist.ENV_JOIN_TIMEOUT: str(join_s)})
    return env


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()
    stream.close()


def launch(script: str, args: list[str] = (), *, num_processes: int = 2,
           devices_per_process: int = 4, heartbeat_timeout_s: float = 20.0,
           join_timeout_s: float = 120.0, timeout_s: float | None = None,
           out=None) -> LaunchResult:
    """Run `script` in `num_processes` local processes that form one
    JAX job; returns each process's status. Every wait is bounded: a failed process stops the
    others within about `heartbeat_timeout_s` (they exit on their own; past twice that, the
    launcher kills them), and `timeout_s` (None: no limit) bounds the whole run."""
    out = out or sys.stdout
    if num_processes < 1 or devices_per_process < 1:
        raise InvalidArgumentError(
            f"autopar.launch: --num-processes={num_processes} and --devices-per-process="
            f"{devices_per_process} must both be >= 1.")
    coordinator = f"127.0.0.1:{dist.free_port()}"
    procs = []
    for i in range(num_processes):
        cmd = [sys.executable, "-m", "autopar.launch", _CHILD, script, *args]
        env = _child_env(i, num_processes, devices_per_process, coordinator,
                         heartbeat_timeout_s, join_timeout_s)
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=_pump, args=(p.stdout, f"[process {i}] ", out),
                         daemon=True).start()
        procs.append(p)
    t0 = time.monotonic()
    first, failed_at, message = None, None, ""
    try:
        while [p.poll() for p in procs].count(None):      # poll every one of them
            now = time.monotonic()
            for i, p in enumerate(procs):
                if first is None and p.returncode not in (None, 0):
                    first, failed_at = i, now
                    out.write(f"autopar.launch: process {i} {_describe(p.returncode)}; the "
                              f"others stop within about {heartbeat_timeout_s:.0f} s\n")
            if failed_at is not None and now - failed_at > 2 * heartbeat_timeout_s + 10:
                _kill(procs)
                message = "killed the processes still running after the failure"
            if timeout_s is not None and now - t0 > timeout_s:
                running = [i for i, p in enumerate(procs) if p.poll() is None]
                _kill(procs)
                message = f"time-out after {timeout_s:.0f} s; killed processes {running}"
            time.sleep(0.1)
    except KeyboardInterrupt:
        _kill(procs)
        raise
    codes = tuple(p.wait() for p in procs)
    if first is None and any(codes):
        first = next(i for i, c in enumerate(codes) if c)
    if first is not None:
        parts = [f"process {i} {_describe(c)}" for i, c in enumerate(codes) if c]
        message = (f"autopar.launch: process {first} failed first; " + "; ".join(parts)
                   + (f" ({message})" if message else "")
                   + ". Read the [process i] lines above for the error.")
    else:
        message = f"autopar.launch: all {num_processes} processes finished"
    out.write(message + "\n")
    out.flush()
    return LaunchResult(returncodes=codes, first_failure=first, message=message)


def _kill(procs) -> None:
    for p in procs:     # SIGTERM is intercepted once jax.distributed is up: kill outright
        if p.poll() is None:
            p.kill()


def _run_child(argv: list[str]) -> None:
    dist.init_distributed()
    script = argv[0]
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == _CHILD:
        _run_child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m autopar.launch",
        description="Run a script as N local processes of one JAX job (simulated CPU hosts).")
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--heartbeat-timeout", type=float, default=20.0,
                        help="seconds of silence after which a process counts as dead")
    parser.add_argument("--join-timeout", type=float, default=120.0,
                        help="seconds to wait for every process to join")
    parser.add_argument("--timeout", type=float, default=None,
                        help="kill every process after this many seconds")
    parser.add_argument("script", help="the Python script to run in every process")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    script, args = ns.script, list(ns.args)
    if not os.path.exists(script):
        parser.error(f"script {script!r} does not exist")
    result = launch(script, args, num_processes=ns.num_processes,
                    devices_per_process=ns.devices_per_process,
                    heartbeat_timeout_s=ns.heartbeat_timeout, join_timeout_s=ns.join_timeout,
                    timeout_s=ns.timeout)
    if result.first_failure is None:
        return 0
    code = result.returncodes[result.first_failure]
    return code if code > 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
