"""`python -m autopar launch`: try a multi-host run on one machine.

Starts N processes on 127.0.0.1, each with K simulated CPU devices (CPU collectives through
gloo), joins them into one JAX job (`autopar.init_distributed`, called for the script) and
runs the same script in each, like one controller process per host. Their output is printed
with a `[process i]` prefix. If one process fails, the others stop within the heartbeat
time-out with an error that names it (they never hang), and the launcher exits with the first
failure's status.

    python -m autopar launch --num-processes 2 --devices-per-process 4 examples/multihost_gpt.py
    autopar launch --num-processes 2 --devices-per-process 4 examples/multihost_gpt.py

Gloo's connection reports (`[Gloo] Rank 0 is connected to 1 peer ranks. ...`, several per
process and collective set-up) are hidden unless `--verbose`; the launcher's last line says how
many it hid.

On a real cluster, run the script on every host instead and call `autopar.init_distributed()`
at its top (it reads SLURM and the other schedulers' variables, or `JAX_COORDINATOR_ADDRESS`).
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from autopar.core.errors import InvalidArgumentError
from autopar.runtime import distributed as dist

_CHILD = "--_child"
# What the children's Gloo prints while it connects, e.g. "[Gloo] Rank 0 is connected to 1 peer
# ranks. Expected number of connected peer ranks is : 1" (one line per rank and collective
# context: a dozen for a 2-process pipeline).
_CHATTER = re.compile(r"^\[Gloo\] .*\bconnected\b")


def is_chatter(line: str) -> bool:
    """Whether a child's output line is Gloo's connection chatter (hidden unless --verbose).

    Example:
        >>> is_chatter("[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of "
        ...            "connected peer ranks is : 1")
        True
        >>> is_chatter("[host 0/2] step 0  loss 7.486211")
        False
    """
    return bool(_CHATTER.match(line))


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


def _pump(stream, prefix: str, out, hidden: list | None) -> None:
    """Copy a child's lines to `out` with `prefix`; chatter is counted in `hidden` instead
    (None: nothing is hidden)."""
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        if hidden is not None and is_chatter(text):
            hidden.append(1)
            continue
        out.write(prefix + text)
        out.flush()
    stream.close()


def launch(script: str, args: list[str] = (), *, num_processes: int = 2,
           devices_per_process: int = 4, heartbeat_timeout_s: float = 20.0,
           join_timeout_s: float = 120.0, timeout_s: float | None = None,
           out=None, hide_chatter: bool = True) -> LaunchResult:
    """Run `script` in `num_processes` local processes that form one
    JAX job; returns each process's status. Every wait is bounded: a failed process stops the
    others within about `heartbeat_timeout_s` (they exit on their own; past twice that, the
    launcher kills them), and `timeout_s` (None: no limit) bounds the whole run.
    `hide_chatter` drops Gloo's connection lines (`is_chatter`) from the children's output."""
    out = out or sys.stdout
    if num_processes < 1 or devices_per_process < 1:
        raise InvalidArgumentError(
            f"autopar launch: --num-processes={num_processes} and --devices-per-process="
            f"{devices_per_process} must both be >= 1.")
    coordinator = f"127.0.0.1:{dist.free_port()}"
    procs, pumps, hidden = [], [], ([] if hide_chatter else None)
    for i in range(num_processes):
        cmd = [sys.executable, "-m", "autopar.runtime.launch", _CHILD, script, *args]
        env = _child_env(i, num_processes, devices_per_process, coordinator,
                         heartbeat_timeout_s, join_timeout_s)
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        pump = threading.Thread(target=_pump, args=(p.stdout, f"[process {i}] ", out, hidden),
                                daemon=True)
        pump.start()
        procs.append(p)
        pumps.append(pump)
    t0 = time.monotonic()
    first, failed_at, message = None, None, ""
    try:
        while [p.poll() for p in procs].count(None):      # poll every one of them
            now = time.monotonic()
            for i, p in enumerate(procs):
                if first is None and p.returncode not in (None, 0):
                    first, failed_at = i, now
                    out.write(f"autopar launch: process {i} {_describe(p.returncode)}; the "
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
    for pump in pumps:          # the children's last lines come before the summary
        pump.join(timeout=5.0)
    if first is None and any(codes):
        first = next(i for i, c in enumerate(codes) if c)
    if first is not None:
        parts = [f"process {i} {_describe(c)}" for i, c in enumerate(codes) if c]
        message = (f"autopar launch: process {first} failed first; " + "; ".join(parts)
                   + (f" ({message})" if message else "")
                   + ". Read the [process i] lines above for the error.")
    else:
        message = f"autopar launch: all {num_processes} processes finished"
    if hidden:
        message += f" ({len(hidden)} Gloo connection lines hidden; --verbose shows them)"
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's options, shared by `python -m autopar launch` and `autopar launch`."""
    parser.add_argument("--num-processes", type=int, required=True,
                        help="how many processes (simulated hosts) to start")
    parser.add_argument("--devices-per-process", type=int, default=4,
                        help="simulated CPU devices in each process")
    parser.add_argument("--heartbeat-timeout", type=float, default=20.0,
                        help="seconds of silence after which a process counts as dead")
    parser.add_argument("--join-timeout", type=float, default=120.0,
                        help="seconds to wait for every process to join")
    parser.add_argument("--timeout", type=float, default=None,
                        help="kill every process after this many seconds (default: no limit)")
    parser.add_argument("script", help="the Python script to run in every process")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="arguments passed on to the script")


def run(ns: argparse.Namespace, parser: argparse.ArgumentParser, *, verbose: bool = False,
        out=None) -> int:
    """Launch as parsed by `add_arguments`; bad values go to `parser.error` (exit 2). Returns
    0, or the status of the process that failed first (128 + N for one killed by signal N)."""
    if ns.num_processes < 1:
        parser.error(f"--num-processes={ns.num_processes} must be >= 1")
    if ns.devices_per_process < 1:
        parser.error(f"--devices-per-process={ns.devices_per_process} must be >= 1")
    for flag, value in (("--heartbeat-timeout", ns.heartbeat_timeout),
                        ("--join-timeout", ns.join_timeout), ("--timeout", ns.timeout)):
        if value is not None and not value > 0:
            parser.error(f"{flag}={value} must be a positive number of seconds")
    if not os.path.exists(ns.script):
        parser.error(f"script {ns.script!r} does not exist")
    result = launch(ns.script, list(ns.args), num_processes=ns.num_processes,
                    devices_per_process=ns.devices_per_process,
                    heartbeat_timeout_s=ns.heartbeat_timeout, join_timeout_s=ns.join_timeout,
                    timeout_s=ns.timeout, out=out, hide_chatter=not verbose)
    if result.first_failure is None:
        return 0
    code = result.returncodes[result.first_failure]
    return code if code > 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == _CHILD:
        _run_child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m autopar launch",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run a script as N local processes of one JAX job (simulated CPU hosts).")
    parser.add_argument("--verbose", action="store_true",
                        help="show Gloo's connection chatter from the processes")
    add_arguments(parser)
    ns = parser.parse_args(argv)
    return run(ns, parser, verbose=ns.verbose)


if __name__ == "__main__":
    sys.exit(main())
