"""autopar.inter_op.parallel: the planner's worker processes. Results in input order, a call's
exception raised where its result is read, a dead worker as a clear error for its call and the
queued ones (no hang), arguments that cannot be sent, the log records of a call, the worker
count from the option or the environment, and a worker that imports no JAX. Worker calls are
stdlib functions (`eval` of a short expression): the test modules import JAX and the workers
must not."""
import logging
import os
import time

import numpy as np
import pytest

import autopar
from autopar.inter_op.parallel import ENV_WORKERS, PlanPool, PlanWorkerError, plan_workers
from autopar.intra_op.ilp import IlpEdge, IlpProblem, solve_ilp


def _problems(n, seed=0):
    rng = np.random.default_rng(seed)
    return [IlpProblem(node_costs=tuple(rng.random(4) for _ in range(6)),
                       edges=tuple(IlpEdge(u=g, v=g + 1, cost=rng.random((4, 4)))
                                   for g in range(5))) for _ in range(n)]


def test_results_come_in_input_order_and_equal_in_process_solves():
    probs = _problems(6)
    with PlanPool(2) as pool:
        # The first calls sleep longest: they finish last, their results still come first.
        slow = pool.map(eval, [(f"__import__('time').sleep({0.3 - 0.05 * i}) or {i}",)
                               for i in range(6)])
        sols = pool.map(solve_ilp, [(p,) for p in probs])
        assert pool.num_calls == 12
    assert slow == list(range(6))
    assert [s.choice for s in sols] == [solve_ilp(p).choice for p in probs]
    assert [s.objective for s in sols] == [solve_ilp(p).objective for p in probs]


def test_one_worker_runs_in_this_process():
    with PlanPool(1) as pool:
        assert pool.inline
        assert pool.submit(os.getpid).result() == os.getpid()
    with PlanPool(2) as pool:
        assert pool.submit(os.getpid).result() != os.getpid()


def test_worker_imports_no_jax():
    with PlanPool(2) as pool:
        loaded = pool.submit(eval, "sorted(__import__('sys').modules)").result()
        pool.map(solve_ilp, [(p,) for p in _problems(2)])
        after = pool.submit(eval, "sorted(__import__('sys').modules)").result()
    assert "jax" not in loaded and "jax" not in after and "flax" not in after
    assert "autopar.intra_op.ilp" in after


def test_a_calls_exception_is_raised_where_its_result_is_read():
    with PlanPool(2) as pool:
        bad = pool.submit(int, "seven")
        good = pool.submit(int, "7")
        with pytest.raises(ValueError, match="seven") as e:
            bad.result()
        assert good.result() == 7           # the pool goes on
        assert any("planning worker" in n for n in getattr(e.value, "__notes__", ()))


@pytest.mark.parametrize("how,match", [
    ("__import__('os')._exit(3)", "exited with status 3"),
    ("__import__('os').kill(__import__('os').getpid(), 9)", "killed by signal 9")])
def test_a_dead_worker_fails_its_call_and_the_queued_ones(how, match):
    t0 = time.perf_counter()
    with PlanPool(2) as pool:
        calls = [pool.submit(eval, "__import__('time').sleep(0.2)") for _ in range(2)]
        dead = pool.submit(eval, how)
        queued = [pool.submit(eval, "__import__('time').sleep(0.1)") for _ in range(20)]
        with pytest.raises(PlanWorkerError, match=match) as e:
            dead.result(timeout=30)
        assert "workers=1" in str(e.value)         # says how to plan without workers
        failed = 0
        for f in queued:                           # each answered or failed, none hangs
            try:
                f.result(timeout=30)
            except PlanWorkerError:
                failed += 1
        assert failed >= 1
        assert all(c.exception(timeout=30) is None for c in calls)
        with pytest.raises(PlanWorkerError):       # the pool stays broken
            pool.submit(eval, "1").result(timeout=30)
    assert time.perf_counter() - t0 < 30


def test_unpicklable_arguments_are_a_clear_error():
    with PlanPool(2) as pool:
        with pytest.raises(autopar.InvalidArgumentError, match="cannot send.*picklable"):
            pool.submit(len, lambda: 0).result(timeout=30)
        assert pool.submit(len, [1, 2]).result(timeout=30) == 2


def test_a_call_the_worker_cannot_load_is_a_clear_error():
    with PlanPool(2) as pool:       # this test module is not importable in a worker
        with pytest.raises(PlanWorkerError, match="cannot load its call"):
            pool.submit(_local_fn).result(timeout=30)
        assert pool.submit(len, "ab").result(timeout=30) == 2     # the worker lives on


def _local_fn():
    return 0


def test_close_stops_busy_workers():
    pool = PlanPool(2)
    busy = pool.submit(eval, "__import__('time').sleep(60)")
    time.sleep(0.5)
    t0 = time.perf_counter()
    pool.close()
    assert time.perf_counter() - t0 < 15
    assert busy.done() or busy.cancelled()
    assert all(p.poll() is not None for p in pool._procs)
    with pytest.raises(autopar.InvalidArgumentError, match="after close"):
        pool.submit(len, [])


def test_worker_log_records_are_logged_here(caplog):
    caplog.set_level(logging.INFO, logger="autopar")
    with PlanPool(2) as pool:
        pool.submit(eval, "__import__('logging').getLogger('autopar.x').warning('from %s', 7)"
                    ).result(timeout=30)
    (rec,) = [r for r in caplog.records if r.name == "autopar.x"]
    assert rec.levelno == logging.WARNING and rec.getMessage().startswith("from 7 [planning")


def test_worker_count(monkeypatch):
    monkeypatch.delenv(ENV_WORKERS, raising=False)
    assert plan_workers(3) == 3
    assert 1 <= plan_workers(None) <= 16
    monkeypatch.setenv(ENV_WORKERS, "2")
    assert plan_workers(None) == 2 and plan_workers(1) == 1       # the option wins
    monkeypatch.setenv(ENV_WORKERS, "two")
    with pytest.raises(autopar.InvalidArgumentError, match=f"{ENV_WORKERS}='two'"):
        plan_workers(None)
    monkeypatch.setenv(ENV_WORKERS, "0")
    with pytest.raises(autopar.InvalidArgumentError, match=f"{ENV_WORKERS}=0"):
        plan_workers(None)
    for bad in (0, True, 1.5):
        with pytest.raises(autopar.InvalidArgumentError, match="AutoStageOption.workers"):
            autopar.AutoStageOption(workers=bad)
        with pytest.raises(autopar.InvalidArgumentError, match="int >= 1"):
            PlanPool(bad)
