"""Progress output (`autopar.progress`): the phases of planning and compiling reported with
their times (log records off a terminal, a live bar on one), `verbose` / AUTOPAR_VERBOSE
respected, and no solver writing to stdout while planning."""
import io
import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import pytest

import autopar
from autopar.core import progress
from support.steps import assert_equivalent, make_case, mesh_of, run_steps, sgd_momentum_clip

LOGGER = "autopar.core.progress"
TIME = r"\d+\.\d+ (?:s|ms|us)"        # _format.format_time: "1.234 s", "12.345 ms", "3.2 us"


class FakeTty(io.StringIO):
    def isatty(self):
        return True


def _records(caplog, event=None):
    return [r for r in caplog.records if r.name == LOGGER
            and (event is None or r.autopar_event == event)]


def _ended(caplog) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in _records(caplog, "end"):
        out.setdefault(r.autopar_phase, []).append(r.autopar_seconds)
    return out


def _case():
    return make_case("mlp", "linen", sgd_momentum_clip(),
                     value_and_grad=autopar.value_and_grad)


def test_single_mesh_first_call_reports_each_phase_with_its_time(caplog):
    step, state, batches = _case()
    peak = autopar.parallelize(step, mesh=mesh_of((2, 4)), verbose=False).get_plan(
        state, batches[0]).peak_memory_bytes
    assert not _records(caplog)            # verbose=False: no progress record at all
    # A budget the plan binds: the memory check compiles it (and the first call reuses that).
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), verbose=True, method=
                              autopar.ShardParallel(memory_budget_bytes=int(1.5 * peak)))
    got = run_steps(par, state, batches[:1])
    assert_equivalent(run_steps(jax.jit(step), state, batches[:1]), got, compare_params=True)
    ended = _ended(caplog)
    assert {"trace", "intra-op ILP", "memory check"} <= set(ended), ended
    assert all(s >= 0 for times in ended.values() for s in times)
    ilp = next(r.getMessage() for r in _records(caplog, "end")
               if r.autopar_phase == "intra-op ILP")
    assert re.match(rf"autopar: step: intra-op ILP: {TIME}; \d+ variables, \d+ "
                    rf"constraints, optimal \(\w+\), built in {TIME}, solved in {TIME}", ilp), ilp
    starts = {r.autopar_phase for r in _records(caplog, "start")}
    assert {"intra-op ILP", "memory check"} <= starts
    # The lowering and XLA compile ran inside the memory check: details at verbose=1.
    assert "XLA compile" not in ended
    n = len(_records(caplog))
    run_steps(par, state, batches[1:2])     # planned and compiled: nothing more to report
    assert len(_records(caplog)) == n


def test_first_call_compile_and_lowering_are_reported(caplog):
    step, state, batches = _case()
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), verbose=1)
    par.get_plan(state, batches[0])
    assert "XLA compile" not in _ended(caplog)       # planning only
    par(state, batches[0])
    ended = _ended(caplog)
    assert {"trace", "intra-op ILP", "lowering", "XLA compile"} <= set(ended), ended


def test_pipeline_reports_stage_search_k_of_n(caplog):
    step, state, batches = _case()
    method = autopar.PipeshardParallel(
        num_microbatches=2, stage_option=autopar.AutoStageOption(workers=1),
        layer_option=autopar.AutoLayerOption(num_layers=2))
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method, verbose=2)
    got = run_steps(par, state, batches[:1])
    assert_equivalent(run_steps(jax.jit(step), state, batches[:1]), got, compare_params=True,
                      rtol=2e-5)
    ended = _ended(caplog)
    assert {"trace", "stage search", "layer plans", "lowering",
            "first step (XLA compiles the stages)"} <= set(ended), ended
    counts = [tuple(map(int, re.search(r"layer plans (\d+) of (\d+), [\d.]+ s, about \d+ s "
                                       r"left", r.getMessage()).groups()))
              for r in _records(caplog, "step") if r.autopar_phase == "layer plans"]
    total = counts[0][1]
    assert [k for k, _ in counts[:total - 1]] == list(range(1, total)), counts
    search = next(r.getMessage() for r in _records(caplog, "end")
                  if r.autopar_phase == "stage search")
    assert re.search(r"2 stage\(s\), \d+ ILPs solved", search), search
    # verbose=2 shows the phases inside others: the stage search's stage traces.
    traces = [r for r in _records(caplog, "end") if r.autopar_phase == "trace"]
    assert len(traces) > 2


def test_environment_variable_sets_the_default(caplog, monkeypatch):
    step, state, batches = _case()
    monkeypatch.setenv(progress.ENV, "1")
    autopar.parallelize(step, mesh=mesh_of((2, 4))).get_plan(state, batches[0])
    assert "intra-op ILP" in _ended(caplog)
    caplog.clear()
    monkeypatch.setenv(progress.ENV, "0")
    autopar.parallelize(step, mesh=mesh_of((2, 4))).get_plan(state, batches[0])
    assert not _records(caplog)
    caplog.clear()
    monkeypatch.setenv(progress.ENV, "1")       # an explicit argument wins
    autopar.parallelize(step, mesh=mesh_of((2, 4)), verbose=False).get_plan(state, batches[0])
    assert not _records(caplog)


def test_default_is_on_for_a_terminal_only(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    assert progress.verbosity(None, io.StringIO()) == progress.Verbosity.QUIET
    assert progress.verbosity(None, FakeTty()) == progress.Verbosity.PROGRESS
    assert progress.verbosity(2, io.StringIO()) == progress.Verbosity.DETAIL


def test_bad_verbose_values_are_rejected(monkeypatch):
    step = _case()[0]
    with pytest.raises(autopar.InvalidArgumentError, match=r"verbose=3 must be"):
        autopar.parallelize(step, verbose=3)
    with pytest.raises(autopar.InvalidArgumentError, match=r"verbose='yes' must be"):
        autopar.parallelize(step, verbose="yes")
    monkeypatch.setenv(progress.ENV, "loud")
    with pytest.raises(autopar.InvalidArgumentError, match=r"AUTOPAR_VERBOSE='loud'"):
        progress.verbosity(None)


def test_autopar_plan_takes_verbose(caplog):
    step, state, batches = _case()
    cluster = autopar.ClusterSpec.preset("dgx-a100", num_hosts=1)
    autopar.plan(step, state, batches[0], cluster=cluster, verbose=True)
    assert {"trace", "intra-op ILP"} <= set(_ended(caplog))


def test_a_plan_cache_hit_says_so_and_searches_nothing(caplog, tmp_path):
    step, state, batches = _case()
    autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=tmp_path, verbose=False
                        ).get_plan(state, batches[0])
    caplog.clear()
    autopar.parallelize(step, mesh=mesh_of((2, 4)), plan_cache=tmp_path, verbose=True
                        ).get_plan(state, batches[0])
    ended = _ended(caplog)
    assert "plan cache" in ended and "intra-op ILP" not in ended
    hit = next(r.getMessage() for r in _records(caplog, "end") if r.autopar_phase == "plan cache")
    assert "hit, no search (searched 20" in hit and str(tmp_path) in hit


def test_terminal_shows_a_bar_and_a_line_per_phase(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger=LOGGER)     # logging does not show INFO
    tty = FakeTty()
    monkeypatch.setattr(sys, "stderr", tty)
    step, state, batches = _case()
    autopar.parallelize(step, mesh=mesh_of((2, 4)), verbose=True).get_plan(state, batches[0])
    with progress.session(True, "job", stream=tty):
        for _ in progress.each(range(3), 3, "layer plans"):
            pass
    out = tty.getvalue()
    assert re.search(rf"autopar: step: intra-op ILP: {TIME}; \d+ variables", out), out
    assert "autopar: job: layer plans: 3 of 3 in" in out
    assert "\x1b[" in out                 # the live display drew (and cleared) itself
    assert not _records(caplog)           # on a terminal the lines are not logged twice


def test_without_logging_handlers_lines_go_to_stderr(monkeypatch):
    monkeypatch.setattr(logging.getLogger(LOGGER), "propagate", False)
    out = io.StringIO()
    with progress.session(1, "job", stream=out):
        with progress.phase("trace") as ph:
            ph.done("3 operators")
        with pytest.raises(ValueError):
            with progress.phase("XLA compile"):
                raise ValueError("boom")
    lines = out.getvalue().splitlines()
    assert lines[0] == "autopar: job: trace ..."
    assert re.fullmatch(rf"autopar: job: trace: {TIME}; 3 operators", lines[1]), lines
    assert re.search(r" (?:ms|us); ", lines[1]), lines      # a short phase: not "0.00 s"
    assert re.fullmatch(rf"autopar: job: XLA compile: failed after {TIME} \(ValueError\)",
                        lines[3]), lines


def test_no_phase_output_outside_a_session(caplog):
    with progress.phase("trace") as ph:
        ph.done("x")
    progress.counter(2, "layer plans").advance(2)
    assert not _records(caplog)


def test_no_solver_writes_to_stdout_while_planning(tmp_path):
    """fd 1 of a process planning with each backend (HiGHS's banner and CBC's log are
    below Python: only a subprocess's stdout sees them)."""
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        import autopar
        from support.steps import make_case, sgd_momentum_clip
        step, state, batches = make_case("mlp", "linen", sgd_momentum_clip(),
                                         value_and_grad=autopar.value_and_grad)
        cluster = autopar.ClusterSpec.preset("dgx-a100", num_hosts=1)
        for backend in autopar.SolverBackend:
            p = autopar.plan(step, state, batches[0], cluster=cluster, verbose=False,
                             method=autopar.ShardParallel(solver=backend))
            assert p.ilp["backend"] == backend.value, p.ilp
            sys.stderr.write(f"planned with {backend.value}\\n")
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(os.path.dirname(__file__)), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("planned with") == len(autopar.SolverBackend), done.stderr[-3000:]
    assert done.stdout == ""
