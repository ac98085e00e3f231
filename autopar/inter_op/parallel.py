"""Worker processes for the planner: "call these independent functions, results in input
order", for the ILP solves of the stage search (see `batch.py`, which feeds it).

A `PlanPool` of N >= 2 workers starts N Python processes on first use (`subprocess`, never a
fork of this process: JAX runs threads here). A worker imports only what its calls need: its
bootstrap registers the `autopar` packages without running their `__init__` (no JAX), so
solving an `IlpProblem` loads numpy, the ILP modules and the solver. Calls and results cross
pipes as pickles (a module-level function and picklable arguments); the records the call logs
come back with its result and are logged here. `PlanPool(1)` runs each call in this process
when it is submitted: the sequential reference.

A worker that dies fails its call and every queued one with `PlanWorkerError` (never a hang);
`close()` (or leaving the `with` block) stops the workers, killing busy ones.

Example:
    >>> from autopar.intra_op.ilp import solve_ilp
    >>> with PlanPool(2) as pool:
    ...     sols = pool.map(solve_ilp, [(p,) for p in problems])   # in input order
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from autopar.core.errors import AutoparError, InvalidArgumentError

log = logging.getLogger(__name__)

ENV_WORKERS = "AUTOPAR_PLAN_WORKERS"
MAX_DEFAULT_WORKERS = 16
_HEADER = struct.Struct("<Q")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The worker's bootstrap: the autopar packages as bare modules (their __init__ imports JAX),
# then the serve loop of this module. argv: [root of the autopar package, log level].
_BOOT = """
import os, sys, types
root = sys.argv[1]
for name in ("autopar", "autopar.inter_op", "autopar.intra_op"):
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(root, *name.split("."))]
    sys.modules[name] = mod
from autopar.inter_op.parallel import serve
serve(int(sys.argv[2]))
"""


class PlanWorkerError(AutoparError):
    """A planning worker process died (crashed, was killed, ran out of memory) or a call
    could not be sent to it."""


def plan_workers(workers: int | None, where: str = "AutoStageOption.workers") -> int:
    """How many worker processes the stage search uses: `workers` when given; else the
    environment variable AUTOPAR_PLAN_WORKERS; else the CPUs this process may use less one
    (this process builds the ILPs the workers solve), at most 16. 1 solves everything in
    this process.

    Example:
        >>> plan_workers(1)
        1
        >>> os.environ["AUTOPAR_PLAN_WORKERS"] = "2"; plan_workers(None)
        2
    """
    if workers is None:
        text = os.environ.get(ENV_WORKERS, "").strip()
        if not text:
            return max(1, min(_cpus() - 1, MAX_DEFAULT_WORKERS))
        where = f"the environment variable {ENV_WORKERS}"
        try:
            workers = int(text)
        except ValueError:
            raise InvalidArgumentError(
                f"{where}={text!r} is not an integer. Fix: set it to the number of planning "
                "worker processes (1: plan in this process), or unset it.") from None
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(
            f"{where}={workers!r} must be an int >= 1 (1: plan in this process; None: "
            f"{ENV_WORKERS} or the CPU count).")
    return workers


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class PlanPool:
    """`workers` processes that run `fn(*args, **kwargs)` calls (see the module docstring);
    started on the first `submit`. With `workers=1` every call runs in this process."""

    def __init__(self, workers: int = 1):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidArgumentError(f"PlanPool(workers={workers!r}) needs an int >= 1.")
        self.workers = workers
        self.num_calls = 0
        self.busy_s = 0.0                # summed time of the calls (in workers or here)
        self._tasks: queue.Queue = queue.Queue()
        self._procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._broken: PlanWorkerError | None = None
        self._closed = False

    @property
    def inline(self) -> bool:
        """True when calls run in this process."""
        return self.workers == 1

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run `fn(*args, **kwargs)`; its future holds the result or the exception it raised
        (as the call would raise it here)."""
        if self._closed:
            raise InvalidArgumentError("PlanPool.submit after close(). Fix: submit inside the "
                                       "pool's `with` block.")
        fut: Future = Future()
        self.num_calls += 1
        if self.inline:
            t0 = time.perf_counter()
            try:
                fut.set_result(fn(*args, **kwargs))
            except Exception as e:        # noqa: BLE001 -- handed to the caller by result()
                fut.set_exception(e)
            self.busy_s += time.perf_counter() - t0
            return fut
        with self._lock:
            if self._broken is not None:
                fut.set_exception(self._broken)
                return fut
            if not self._procs:
                self._start()
            self._tasks.put((fut, fn, args, kwargs))
        return fut

    def map(self, fn: Callable, arg_tuples: Sequence[tuple]) -> list:
        """`[fn(*a) for a in arg_tuples]`, the calls spread over the workers; results in input
        order. Raises the first failed call's exception (in input order)."""
        futures = [self.submit(fn, *a) for a in arg_tuples]
        return [f.result() for f in futures]

    def _start(self) -> None:
        level = logging.getLogger("autopar").getEffectiveLevel()
        for n in range(self.workers):
            try:
                proc = subprocess.Popen([sys.executable, "-c", _BOOT, _ROOT, str(level)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        close_fds=True)
            except OSError as e:
                self._closed = True
                raise PlanWorkerError(
                    f"cannot start planning worker process {n + 1} of {self.workers} with "
                    f"{sys.executable!r}: {e}. Fix: workers=1 (AutoStageOption or "
                    f"{ENV_WORKERS}) to plan in this process.") from e
            self._procs.append(proc)
            th = threading.Thread(target=self._feed, args=(proc,), daemon=True,
                                  name=f"autopar-plan-worker-{n}")
            th.start()
            self._threads.append(th)
        log.info("autopar: started %d planning worker processes (pids %s)", self.workers,
                 ", ".join(str(p.pid) for p in self._procs))

    def _feed(self, proc: subprocess.Popen) -> None:
        """One worker's thread: send it a queued call, wait for its answer, repeat."""
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fut, fn, args, kwargs = task
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:        # noqa: BLE001 -- the caller's argument
                fut.set_exception(InvalidArgumentError(
                    f"cannot send {_name(fn)} to a planning worker: {type(e).__name__}: {e}. "
                    "Fix: pass a module-level function and picklable arguments, or use "
                    "workers=1."))
                continue
            try:
                _write(proc.stdin, payload)
                ok, value, logs, busy = pickle.loads(_read(proc.stdout))
            except (OSError, EOFError, pickle.UnpicklingError) as e:
                self._fail(proc, fut, fn, e)
                return
            with self._lock:
                self.busy_s += busy
            _relog(logs)
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    def _fail(self, proc: subprocess.Popen, fut: Future, fn: Callable, cause) -> None:
        """The worker is gone: fail its call and every queued one; later submits fail too."""
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        how = (f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        err = PlanWorkerError(
            f"planning worker process {proc.pid} {how} while running {_name(fn)} "
            f"({type(cause).__name__}: {cause}); its error output, if any, is above. A killed "
            "worker often ran out of memory. Fix: fewer workers (AutoStageOption(workers=...) "
            f"or {ENV_WORKERS}), or workers=1 to plan in this process.")
        with self._lock:
            self._broken = err
            fut.set_exception(err)
            while True:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is None:
                    self._tasks.put(None)        # for the other threads: stop
                    break
                if task[0].set_running_or_notify_cancel():
                    task[0].set_exception(err)
        log.error("autopar: %s", err)

    def close(self) -> None:
        """Stop the workers: idle ones exit; busy ones (their results no longer wanted) are
        killed. Pending futures are cancelled."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            while True:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[0].cancel()
            for _ in self._threads:
                self._tasks.put(None)
        for proc in self._procs:
            if proc.stdin:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for th in self._threads:
            th.join(timeout=5)
        for proc in self._procs:
            if proc.stdout:
                proc.stdout.close()

    def __enter__(self) -> PlanPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True) and getattr(self, "_procs", None):
            self.close()


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _write(stream, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)))
    stream.write(payload)
    stream.flush()


def _read(stream) -> bytes:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the worker's pipe closed")
    size = _HEADER.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError(f"the worker's pipe closed after {len(data)} of {size} bytes")
    return data


def _relog(records: list[dict]) -> None:
    """Log here what a call logged in its worker (only what this process's loggers take)."""
    for d in records:
        logger = logging.getLogger(d["name"])
        if logger.isEnabledFor(d["levelno"]):
            logger.handle(logging.makeLogRecord(d))


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        d = dict(record.__dict__)
        d.update(msg=record.getMessage(), args=None, exc_info=None, exc_text=None)
        d["msg"] += f" [planning worker {os.getpid()}]"
        self.records.append(d)


def serve(level: int = logging.WARNING) -> None:
    """A worker's loop (run by the bootstrap): read a call, run it, write (ok, result or
    exception, log records, seconds), until the parent closes the pipe. The protocol keeps
    its own copy of stdout; what solvers print goes to stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    handler = _Collect()
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level)
    while True:
        try:
            data = _read(inp)
        except EOFError:
            return
        handler.records = []
        t0 = time.perf_counter()
        try:
            fn, args, kwargs = pickle.loads(data)
        except Exception as e:            # noqa: BLE001 -- e.g. a module it cannot import
            fn, args, kwargs = _unloadable, (e,), {}
        try:
            answer = (True, fn(*args, **kwargs))
        except Exception as e:            # noqa: BLE001 -- raised again in the parent
            answer = (False, _picklable(e))
        answer = (*answer, handler.records, time.perf_counter() - t0)
        try:
            payload = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:            # noqa: BLE001 -- an unpicklable result
            payload = pickle.dumps((False, PlanWorkerError(
                f"the result of {_name(fn)} cannot be sent back from its worker: "
                f"{type(e).__name__}: {e}"), handler.records, 0.0))
        _write(out, payload)


def _unloadable(e: Exception):
    raise PlanWorkerError(
        f"a planning worker cannot load its call ({type(e).__name__}: {e}); a worker imports "
        "only autopar's inter_op and intra_op modules and installed packages. Fix: call a "
        "function of those, or use workers=1.")


def _picklable(e: Exception) -> Exception:
    """`e` if it survives a pickle round trip (with its traceback as a note), else a
    PlanWorkerError that quotes it."""
    text = "".join(traceback.format_exception(e))
    try:
        pickle.loads(pickle.dumps(e))
        e.add_note(f"(raised in planning worker {os.getpid()}:\n{text})")
        return e
    except Exception:                     # noqa: BLE001
        return PlanWorkerError(f"a planning worker raised {type(e).__name__}: {e}\n{text}")
