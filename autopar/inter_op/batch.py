"""Many stage-search jobs at once, their ILP solves in worker processes (`parallel.PlanPool`).

A job (one layer on one (submesh, logical view) pair, `stage_costs.layer_options`) builds its
stage ILP here, then solves it through `autopar.intra_op.solve`, which calls
`solve_ilp` / `min_peak_memory` on an `IlpProblem` (numpy arrays only). `run_jobs` runs every
job; inside `ilp_scope(key)` (the `StageSolver` cache entries: `key` names what is computed) a
job's n-th ILP call is sent to the pool as call (key, n), and the job stops (`_Pending`)
until it is answered. Once every job has stopped or finished, a stopped job whose call is
answered runs again from the start: what it built is cached, the calls answered so far return
at once, and its next call goes out. A job's computation is the sequential one, with
the same ILP answers, so the results do not depend on the number of workers; building (in this
process) overlaps with solving (in the workers). Jobs asking the same (key, n) share one call.

The calls are seen through `intra_op.solve.ILP_CALL`, set for the batch's duration: only
calls inside a scope of a running `run_jobs`, in its thread, are deferred; every other call
runs the real function. Caveat: an ILP stopped by its time limit returns the best plan found by
then, which depends on the machine's load, with or without workers.

Example:
    >>> with PlanPool(2) as pool:
    ...     sols = run_jobs(jobs, lambda job: solver.solve(*job), pool)   # in job order
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

from autopar.core import progress
from autopar.inter_op.parallel import PlanPool
from autopar.intra_op.solve import ILP_CALL

log = logging.getLogger(__name__)
_state = threading.local()     # .calls: {(key, n): Future} of the running batch; .scope


class _Pending(Exception):
    """A job asked for an ILP answer that is not in yet (caught by `run_jobs` only)."""


@contextlib.contextmanager
def ilp_scope(key: Hashable):
    """Name the ILP calls made inside: (key, 0), (key, 1), ... (see the module docstring).
    A no-op outside `run_jobs`."""
    if getattr(_state, "calls", None) is None:
        yield
        return
    outer = getattr(_state, "scope", None)
    _state.scope = [key, 0]
    try:
        yield
    finally:
        _state.scope = outer


def run_jobs(jobs: Sequence, fn: Callable, pool: PlanPool | None, what: str = "jobs") -> list:
    """`[fn(job) for job in jobs]`, with the jobs' ILP solves spread over `pool` (in this
    process, one job after another, when the pool has one worker or is None)."""
    if pool is None or pool.inline or not jobs:
        return _in_process(jobs, fn, what)
    if getattr(_state, "calls", None) is not None:
        raise RuntimeError("run_jobs is not reentrant")
    t0, calls0, busy0 = time.perf_counter(), pool.num_calls, pool.busy_s
    results: list = [None] * len(jobs)
    todo, waiting, runs, said = list(range(len(jobs))), {}, 0, t0
    bar = progress.counter(len(jobs), what)
    _state.calls, _state.pool = {}, pool
    token = ILP_CALL.set(_deferred)
    try:
        while True:
            for i in todo:            # in job order; a stopped job waits on one call
                runs += 1
                try:
                    results[i] = fn(jobs[i])
                    bar.advance()
                except _Pending as p:
                    waiting[i] = _state.calls[p.args[0]]
            if not waiting:
                break
            if time.perf_counter() - said > 10.0:
                said = time.perf_counter()
                busy = [f for f in _state.calls.values() if not f.done()]
                log.info("autopar: %s: %d of %d done, %.0f s; %d ILPs solved, %d in %d worker "
                         "processes", what, len(jobs) - len(waiting), len(jobs), said - t0,
                         len(_state.calls) - len(busy), len(busy), pool.workers)
            wait(set(waiting.values()), return_when=FIRST_COMPLETED)
            todo = sorted(i for i, f in waiting.items() if f.done())
            for i in todo:
                del waiting[i]
    finally:
        ILP_CALL.reset(token)
        _state.calls = _state.scope = _state.pool = None
    log.info("autopar: %s: %d done in %.2f s (%d runs): %d ILP calls in %d worker "
             "processes, %.2f s of solving", what, len(jobs), time.perf_counter() - t0,
             runs, pool.num_calls - calls0, pool.workers, pool.busy_s - busy0)
    return results


def _in_process(jobs: Sequence, fn: Callable, what: str) -> list:
    """The sequential reference: one job after another, progress at most every 10 s."""
    t0 = said = time.perf_counter()
    results = []
    for job in progress.each(jobs, len(jobs), what):
        results.append(fn(job))
        if time.perf_counter() - said > 10.0:
            said = time.perf_counter()
            log.info("autopar: %s: %d of %d done, %.0f s (in this process)", what,
                     len(results), len(jobs), said - t0)
    if jobs:
        log.info("autopar: %s: %d done in %.2f s in this process", what, len(jobs),
                 time.perf_counter() - t0)
    return results


def _deferred(real: Callable, problem, *args, **kwargs):
    """`real(problem, ...)` (an ILP function of autopar.intra_op.ilp), deferred inside a scope
    (`intra_op.solve.ILP_CALL` during `run_jobs`)."""
    calls, scope = getattr(_state, "calls", None), getattr(_state, "scope", None)
    if calls is None or scope is None:
        return real(problem, *args, **kwargs)
    key = (scope[0], scope[1])
    scope[1] += 1
    fut: Future | None = calls.get(key)
    if fut is None:
        fut = calls[key] = _state.pool.submit(real, problem, *args, **kwargs)
    if not fut.done():
        raise _Pending(key)
    return fut.result()
