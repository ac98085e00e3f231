"""Progress output while autopar plans and compiles a step (the first call can take minutes).

What is shown is set per call of `parallelize(..., verbose=...)` / `autopar.plan(...,
verbose=...)`:

- `verbose=None` (default): the environment variable `AUTOPAR_VERBOSE` (0, 1 or 2) if set;
  otherwise 1 when stderr is a terminal (in process 0 of a multi-process job), else 0.
- `0` / `False`: nothing (no progress records at all).
- `1` / `True`: one line per finished phase with its time and what it made (phases inside
  another, e.g. the traces of the stage search, only at 2), a line when a long phase
  starts, and for counted work (the stage search's layer ILPs, the stages solved
  whole) a "k of n" line with the time left at most every 5 s and one when it ends.
- `2`: as 1, plus the phases inside others, a start line for every phase and a line for
  every counted step.

Where the lines go: on a terminal (stderr is a TTY) a live progress bar (`rich`) shows the
running phases and counters, and each finished phase is printed above it. Otherwise they are
records of the logger `autopar.progress` at INFO, handled by your logging configuration
(past the logger's level: `verbose` asked for them), or written to stderr when logging has no
handler at all. When your logging already shows INFO records of `autopar.progress`, the
terminal shows only the bar (no line twice).

The `autopar` loggers (`logging.getLogger("autopar")` sets them all):
- `autopar.progress` (INFO): the phase lines above; each record carries
  `autopar_event` ("start" | "end" | "step" | "failed"), `autopar_phase` (e.g. "intra-op
  ILP"), `autopar_step` (the step function's name) and `autopar_seconds` (at "end").
- `autopar.passes`, `autopar.api`, `autopar.pipeshard`, `autopar.inter_op.*` (INFO): what the
  planner decided (ILP sizes and status, stages chosen, remat chosen, plan cache hits).
- WARNING anywhere: something you should look at (a solver fell back to a greedy plan, a
  plan was re-planned after the memory check, an operator fell back to replicated).
- DEBUG: per-ILP details of the stage search.

Phases: "trace", "intra-op ILP", "rematerialization search", "stage search" (counters
"layer plans" and "stages solved whole"), "lowering", "memory check" (compiles a plan whose
budget binds), "XLA compile" and, for pipelines, "first step (XLA compiles the stages)".

Example (a script run in a pipe, or under pytest):
    >>> step = autopar.parallelize(train_step, mesh=mesh, verbose=True)
    >>> state, loss = step(state, batch)              # doctest: +SKIP
    autopar: train_step: trace ...
    autopar: train_step: trace: 310.000 ms; 412 operators, 1033 tensors
    autopar: train_step: intra-op ILP ...
    autopar: train_step: intra-op ILP: 1.420 s; 812 variables, 904 constraints, optimal
    (highs), built in 300.000 ms, solved in 1.120 s
    autopar: train_step: lowering: 50.000 ms
    autopar: train_step: XLA compile ...
    autopar: train_step: XLA compile: 6.100 s

Code hooks its phases with `with progress.phase(name) as ph: ...; ph.done(detail)`, the
`@progress.timed(name, summary)` decorator, `bar = progress.counter(n, label)` and
`bar.advance()` (or `for x in progress.each(items, n, label)`); all are no-ops outside a
`progress.session(verbose, name)` (set for one planning or compiling call, in a context
variable: nothing leaks between functions).
"""
from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from autopar.core._format import format_time
from autopar.core.errors import InvalidArgumentError

log = logging.getLogger(__name__)

ENV = "AUTOPAR_VERBOSE"
STEP_EVERY_S = 5.0       # at verbose=1, a counter's "k of n" line at most this often


class Verbosity(enum.IntEnum):
    QUIET = 0
    PROGRESS = 1
    DETAIL = 2


def check(verbose: Any, where: str = "verbose") -> None:
    """Raise `InvalidArgumentError` unless `verbose` is None, a bool or 0, 1, 2."""
    if verbose is None or isinstance(verbose, bool):
        return
    if not isinstance(verbose, int) or not 0 <= verbose <= 2:
        raise InvalidArgumentError(
            f"{where}={verbose!r} must be None (from ${ENV}, else on for a terminal), "
            "True / False, or 0 (silent), 1 (a line per phase) or 2 (every step).")


def verbosity(verbose: Any = None, stream=None) -> Verbosity:
    """The level for `verbose` (see the module docstring); `stream` is where a terminal is
    looked for (default: stderr).

    Example:
        >>> verbosity(True), verbosity(0)
        (<Verbosity.PROGRESS: 1>, <Verbosity.QUIET: 0>)
    """
    check(verbose)
    if verbose is not None:
        return Verbosity(int(verbose))
    text = os.environ.get(ENV, "").strip()
    if text:
        if text not in ("0", "1", "2"):
            raise InvalidArgumentError(
                f"the environment variable {ENV}={text!r} must be 0 (silent), 1 (a line per "
                "phase) or 2 (every step). Fix: set one of those, or unset it.")
        return Verbosity(int(text))
    return Verbosity.PROGRESS if _is_tty(stream or sys.stderr) and _process_0() \
        else Verbosity.QUIET


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _process_0() -> bool:
    import jax
    return jax.process_index() == 0


class _Phase:
    """A running phase: `done(detail)` sets what its end line says."""
    __slots__ = ("name", "detail", "end_detail", "t0", "task")

    def __init__(self, name: str, detail: str):
        self.name, self.detail, self.end_detail = name, detail, ""
        self.t0, self.task = time.perf_counter(), None

    def done(self, detail: str) -> None:
        self.end_detail = detail


class _Counter:
    """`advance()` once per finished step of a counted phase."""
    __slots__ = ("rep", "label", "total", "k", "t0", "said", "task")

    def __init__(self, rep: _Reporter | None, label: str, total: int):
        self.rep, self.label, self.total, self.k = rep, label, int(total), 0
        self.t0 = self.said = time.perf_counter()
        self.task = None

    def advance(self, n: int = 1) -> None:
        self.k += n
        if self.rep is not None and n:
            self.rep.advanced(self)


_NULL_PHASE = _Phase("", "")


class _Reporter:
    """One session's output: log records, or a `rich` live bar on a terminal."""

    def __init__(self, level: Verbosity, name: str, stream):
        self.level, self.name, self.stream = level, name, stream
        self.depth = 0                       # phases running now, one inside the other
        self.bar = self.console = None
        if _is_tty(stream):
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            self.console = Console(file=stream, highlight=False)
            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(),
                                TimeRemainingColumn(), console=self.console, transient=True)
            self.bar.start()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()

    def _emit(self, text: str, event: str, phase: str, seconds: float | None = None) -> None:
        extra = {"autopar_event": event, "autopar_phase": phase, "autopar_step": self.name,
                 "autopar_seconds": seconds}
        record = log.makeRecord(log.name, logging.INFO, __file__, 0, text, None, None,
                                extra=extra)
        if log.isEnabledFor(logging.INFO) and log.hasHandlers():
            log.handle(record)               # the user's logging shows autopar's INFO records
        elif self.console is not None:
            if event != "start":             # the bar shows what runs
                self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        elif log.hasHandlers():
            log.handle(record)               # verbose asked for them: past the logger's level
        else:
            print(text, file=self.stream, flush=True)

    def prefix(self, phase: str) -> str:
        return f"autopar: {self.name}: {phase}"

    def start(self, ph: _Phase, long: bool) -> None:
        if self.bar is not None:
            ph.task = self.bar.add_task(f"{self.name}: {ph.name}", total=None)
        elif long or self.level >= Verbosity.DETAIL:
            self._emit(self.prefix(ph.name) + (f" ({ph.detail})" if ph.detail else "") + " ...",
                       "start", ph.name)

    def end(self, ph: _Phase, error: BaseException | None) -> None:
        seconds = time.perf_counter() - ph.t0
        if ph.task is not None:
            self.bar.remove_task(ph.task)
        if error is not None:
            self._emit(f"{self.prefix(ph.name)}: failed after {format_time(seconds)} "
                       f"({type(error).__name__})", "failed", ph.name, seconds)
            return
        self._emit(f"{self.prefix(ph.name)}: {format_time(seconds)}" + (
            f"; {ph.end_detail}" if ph.end_detail else ""), "end", ph.name, seconds)

    def counting(self, c: _Counter) -> None:
        if self.bar is not None:
            c.task = self.bar.add_task(f"{self.name}: {c.label}", total=c.total)

    def advanced(self, c: _Counter) -> None:
        if c.k >= c.total:
            self.counted(c)
            return
        if c.task is not None:
            self.bar.update(c.task, completed=c.k)
            return
        now = time.perf_counter()
        if (self.level < Verbosity.DETAIL and now - c.said < STEP_EVERY_S):
            return
        c.said = now
        left = (now - c.t0) / c.k * (c.total - c.k)
        self._emit(f"{self.prefix(c.label)} {c.k} of {c.total}, {now - c.t0:.1f} s, about "
                   f"{left:.0f} s left", "step", c.label)

    def counted(self, c: _Counter) -> None:
        if c.task is not None:
            self.bar.remove_task(c.task)
            c.task = None
        seconds = time.perf_counter() - c.t0
        self._emit(f"{self.prefix(c.label)}: {c.k} of {c.total} in {format_time(seconds)}", "end",
                   c.label, seconds)


_CURRENT: contextvars.ContextVar[_Reporter | bool | None] = contextvars.ContextVar(
    "autopar_progress", default=None)     # a reporter; False: a quiet session; None: none


def _reporter() -> _Reporter | None:
    rep = _CURRENT.get()
    return rep if isinstance(rep, _Reporter) else None


@contextlib.contextmanager
def session(verbose: Any = None, name: str = "step", stream=None) -> Iterator[None]:
    """Show the phases run inside (in this thread / context) at `verbosity(verbose)`, named by
    `name` (the step function's). Inside another session, that one goes on."""
    if _CURRENT.get() is not None:
        yield
        return
    stream = stream or sys.stderr
    level = verbosity(verbose, stream)
    rep = _Reporter(level, name, stream) if level > Verbosity.QUIET else False
    token = _CURRENT.set(rep)
    try:
        yield
    finally:
        _CURRENT.reset(token)
        if rep:
            rep.close()


@contextlib.contextmanager
def phase(name: str, detail: str = "", *, long: bool = True) -> Iterator[_Phase]:
    """A phase: its start (for `long` ones) and end are reported; call `done(detail)` on what
    it yields to say what it made."""
    rep = _reporter()
    if rep is None:
        yield _NULL_PHASE
        return
    ph = _Phase(name, detail)
    shown = rep.depth == 0 or rep.level >= Verbosity.DETAIL   # nested ones: details
    rep.depth += 1
    try:
        if shown:
            rep.start(ph, long)
        yield ph
    except BaseException as e:
        if shown:
            rep.end(ph, e)
        raise
    finally:
        rep.depth -= 1
    if shown:
        rep.end(ph, None)


def timed(name: str, summary: Callable[[Any], str] | None = None, *, long: bool = True):
    """Decorator: each call is a `phase(name)`, its end line saying `summary(result)`.

    Example:
        >>> @timed("trace", lambda g: f"{len(g.nodes)} operators")
        ... def trace(fun, args): ...
    """
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if _reporter() is None:
                return fn(*args, **kwargs)
            with phase(name, long=long) as ph:
                out = fn(*args, **kwargs)
                if summary is not None:
                    ph.done(summary(out))
                return out
        return run
    return wrap


def counter(total: int, label: str) -> _Counter:
    """A counted phase of `total` steps: `advance()` after each; its end line comes with the
    last step (one never finished just leaves the bar when the session ends).

    Example:
        >>> bar = counter(len(jobs), "layer plans")
        >>> for job in jobs:
        ...     run(job); bar.advance()
    """
    rep = _reporter()
    c = _Counter(rep, label, total)
    if rep is not None:
        rep.counting(c)
    return c


def each(items: Iterable, total: int, label: str) -> Iterator:
    """`items`, counted (as `counter`) as the loop asks for the next one."""
    c = counter(total, label)
    for x in items:
        yield x
        c.advance()


def note(name: str, detail: str, seconds: float) -> None:
    """An end line for work timed elsewhere (e.g. a search made of other phases)."""
    rep = _reporter()
    if rep is not None:
        rep._emit(f"{rep.prefix(name)}: {format_time(seconds)}; {detail}", "end", name, seconds)


def compiled(lowered: Callable[[], Any]) -> Any:
    """`lowered().compile()`, as the phases "lowering" and "XLA compile"."""
    with phase("lowering", long=False):
        low = lowered()
    with phase("XLA compile"):
        return low.compile()


_RAN: weakref.WeakSet = weakref.WeakSet()     # pipeline executors past their first step


def first_run(executor, flat_args: list, session_of: Callable) -> list:
    """`executor.run(flat_args)`; its first step, where XLA compiles every stage's
    executables, as the phase "first step (XLA compiles the stages)" in `session_of()`."""
    if executor in _RAN:
        return executor.run(flat_args)
    with session_of(), phase("first step (XLA compiles the stages)"):
        out = executor.run(flat_args)
    _RAN.add(executor)
    return out


def ilp_summary(ilp: dict) -> str:
    """An intra-op ILP's end line from `ParallelPlan.ilp`, e.g. "812 variables, 904
    constraints, optimal (highs), built in 300.000 ms, solved in 1.120 s"."""
    return (f"{ilp['num_variables']} variables, {ilp['num_constraints']} constraints, "
            f"{ilp['status']} ({ilp['backend']}), built in {format_time(ilp['build_time_s'])}, "
            f"solved in {format_time(ilp['solve_time_s'])}")
