"""autopar.inter_op.batch: layer-plan jobs with their ILP solves in worker processes. The
jobs' results equal the sequential ones and shared calls are solved once; a small GPT pipeline
gets the same plan with 1 and 2 workers, and the one planned with 2 trains like `jax.jit` on
one device; a worker error reaches the planner."""
import functools

import jax
import numpy as np
import pytest

import autopar
from autopar.inter_op.batch import ilp_scope, run_jobs
from autopar.inter_op.parallel import PlanPool
from autopar.intra_op.ilp import IlpEdge, IlpProblem, min_peak_memory, solve_ilp
from autopar.intra_op.solve import ilp_call
from autopar.models.gpt import GPTConfig
from support.steps import assert_equivalent, make_case, mesh_of, run_steps, sgd_momentum_clip

GPT4 = GPTConfig(vocab_size=128, seq_len=16, num_layers=4, hidden=32, num_heads=4)


def _problem(seed, budget=None):
    rng = np.random.default_rng(seed)
    return IlpProblem(node_costs=tuple(rng.random(3) for _ in range(5)),
                      edges=tuple(IlpEdge(u=g, v=g + 1, cost=rng.random((3, 3)))
                                  for g in range(4)), memory_budget_bytes=budget)


def _job(seed):
    """Two dependent ILP calls (the second's problem depends on the first's answer), as a
    stage solve makes; jobs with equal seeds share their calls."""
    with ilp_scope(("job", seed)):
        first = ilp_call(solve_ilp, _problem(seed))
        second = ilp_call(solve_ilp, _problem(seed + 100 + first.choice[0]))
        least = ilp_call(min_peak_memory, _problem(seed))
    return first.choice, second.choice, least


def test_jobs_match_the_sequential_results_and_share_calls():
    jobs = [3, 1, 3, 2, 1, 3]
    want = [_job(s) for s in jobs]
    with PlanPool(2) as pool:
        got = run_jobs(jobs, _job, pool)
        assert pool.num_calls == 3 * 3             # 3 distinct jobs x 3 calls each
    assert got == want
    with PlanPool(1) as pool:                      # in process: the plain loop
        assert run_jobs(jobs, _job, pool) == want and pool.num_calls == 0


def test_calls_outside_a_scope_or_a_batch_run_here():
    with PlanPool(2) as pool:
        got = run_jobs([0], lambda s: ilp_call(solve_ilp, _problem(s)).choice, pool)
        assert pool.num_calls == 0                 # no scope: solved in this process
    assert got == [solve_ilp(_problem(0)).choice]


def test_a_workers_exception_reaches_the_job():
    def job(_):
        with ilp_scope("bad"):
            return ilp_call(solve_ilp, _problem(0), time_limit_s=-1.0)
    with PlanPool(2) as pool, pytest.raises(autopar.InvalidArgumentError, match="time_limit"):
        run_jobs([0, 1], job, pool)


def test_a_dead_worker_stops_the_batch_with_a_clear_error():
    import os

    from autopar.inter_op.batch import _deferred
    from autopar.inter_op.parallel import PlanWorkerError
    die = functools.partial(_deferred, os._exit)  # as a deferred ILP call would go out

    def job(n):
        with ilp_scope(("job", n)):
            return die(5) if n == 1 else ilp_call(solve_ilp, _problem(n)).choice
    with PlanPool(2) as pool, pytest.raises(PlanWorkerError, match="exited with status 5"):
        run_jobs([0, 1, 2], job, pool)


def _gpt_case():
    return make_case("gpt", "linen", sgd_momentum_clip(), value_and_grad=autopar.value_and_grad,
                     gpt_config=GPT4, batch_size=16)


def _method(workers):
    return autopar.PipeshardParallel(
        num_microbatches=4, layer_option=autopar.AutoLayerOption(num_layers=4),
        stage_option=autopar.AutoStageOption(logical_shapes="flat", workers=workers))


def _outcome(plan):
    """What the search decided: stages, their ILP solutions (less solver timings), counts."""
    sols = [{k: v for k, v in rec.items() if k != "ilp"} for rec in plan.stage_solutions]
    return (plan.stages, sols, plan.pipeline["num_ilps"], plan.pipeline["num_reused"],
            plan.predicted_step_s, plan.peak_memory_bytes)


@pytest.mark.slow      # the worker pool itself: tests/inter_op/test_parallel.py (make test)
def test_gpt_pipeline_planned_with_two_workers_matches_one_and_jax_jit():
    step, state, batches = _gpt_case()
    par = autopar.parallelize(step, mesh=mesh_of((2, 4)), method=_method(2))
    ref = run_steps(jax.jit(step), state, batches)
    got = run_steps(par, state, batches)
    assert_equivalent(ref, got, compare_params=True, rtol=2e-5, smooth=True)
    two = par.get_plan(state, batches[0])
    one = autopar.plan(step, state, batches[0], cluster=par.cluster, method=_method(1),
                       mesh_shape=(2, 4))
    assert two.pipeline["num_ilps"] > 4            # the search solved several layer ILPs
    assert _outcome(two) == _outcome(one)
