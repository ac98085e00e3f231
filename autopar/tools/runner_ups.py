"""Runner-ups pass ("why this plan"): the plans the standard methods give for the same traced
step, priced under the same cost model, recorded in `ParallelPlan.alternatives`.

On one mesh the rivals are data parallelism, ZeRO-3, ZeRO-2 and the free intra-op ILP
(`ShardParallel()`, without the user's `sharding_rules`), each but the chosen method's own
kind, each solved on the graph the chosen plan was made for (with its recomputation) and the
chosen method's budget and solver settings. Pipelines record the stage layouts the stage
search solved whole and did not take (`inter_op.stage_costs.reranked`).

Pricing a rival is one intra-op ILP of a forced method: its build dominates (a few tenths of
a second on the demo GPT), and costs about what the chosen plan's build did. So that a large
model's first call does not pay for them several times over, a rival is priced only while
the time spent plus that build time stays within `TIME_SHARE` of the search's own time (or
`MIN_TIME_S`, whichever is more); those left are recorded as not priced, with the reason. A
rival whose rules the step cannot take (DataParallel's batch split, when the batch does not
divide over the devices) is recorded as not applicable, with the reason, never raised: the
user did not ask for it.
`AUTOPAR_RUNNER_UPS=all` prices every rival whatever it takes; `AUTOPAR_RUNNER_UPS=off`
skips them (the test suite does, but for its own tests).

    >>> plan = step.get_plan(state, batch)
    >>> for alt in plan.alternatives:
    ...     print(alt["name"], alt["predicted_step_s"], alt["fits"])
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

from autopar.core import progress
from autopar.core._format import NOT_APPLICABLE, runner_up_text
from autopar.core.errors import InfeasiblePlanError, InvalidArgumentError
from autopar.core.options import DataParallel, ShardParallel, Zero2Parallel, Zero3Parallel
from autopar.core.plan import ParallelPlan
from autopar.core.plan import alternative_record as record
from autopar.intra_op.solve import SHARE_COPIES, UNMET_PINS_LEVEL

log = logging.getLogger(__name__)

TIME_SHARE = 0.25    # of the search's time the rivals may take
MIN_TIME_S = 2.0

# (class, what it does), in the order they are priced.
RIVALS: tuple[tuple[type[ShardParallel], str], ...] = (
    (DataParallel, "batch split over every device, parameters and optimizer state "
                   "replicated, one gradient all-reduce"),
    (Zero3Parallel, "data parallel with parameters, gradients and optimizer state split "
                    "over every device, parameters gathered where used"),
    (Zero2Parallel, "data parallel with gradients and optimizer state split, parameters "
                    "replicated"),
    (ShardParallel, "the free intra-op ILP (no sharding rules)"),
)


def rival_of(cls: type[ShardParallel], method: ShardParallel) -> ShardParallel:
    """A method of class `cls` with `method`'s budget and solver settings, no rules."""
    keep = ("memory_budget_bytes", "solver", "solver_time_limit_s", "layer_reuse",
            "annotations")
    return cls(**{k: getattr(method, k) for k in keep})


def with_runner_ups(plan: ParallelPlan, method: ShardParallel,
                    plan_with: Callable[[ShardParallel], ParallelPlan]) -> ParallelPlan:
    """`plan` with `alternatives`: each rival method's plan from `plan_with(method)` (the same
    graph, mesh and cost model), best predicted step first; infeasible ones last with the
    bytes they need. The time taken is `timings_s["runner_ups"]`."""
    if os.environ.get("AUTOPAR_RUNNER_UPS", "").lower() in ("0", "off", "false", "no"):
        return plan
    return _priced(plan, method, plan_with)


@progress.timed("runner-ups", lambda p: ", ".join(
    runner_up_text(a, p.predicted_step_s) for a in p.alternatives))
def _priced(plan: ParallelPlan, method: ShardParallel,
            plan_with: Callable[[ShardParallel], ParallelPlan]) -> ParallelPlan:
    t0 = time.perf_counter()
    cap = max(MIN_TIME_S, TIME_SHARE * sum(plan.timings_s.values()))
    if os.environ.get("AUTOPAR_RUNNER_UPS", "").lower() == "all":
        cap = float("inf")
    each = float(plan.ilp.get("build_time_s", 0.0))      # a rival's ILP build, about
    chosen = method.kind if not method.sharding_rules else None
    budget = float(plan.memory_budget_bytes)
    out = []
    for cls, what in RIVALS:
        rival = rival_of(cls, method)
        if rival.kind == chosen:
            continue
        name = f"{cls.__name__}()"
        if time.perf_counter() - t0 + each > cap:
            out.append({**record(name, "method", None, 0.0, budget, what), "fits": None,
                        "peak_memory_bytes": None,
                        "note": f"not priced: it would take the rivals past their {cap:.1f} s "
                                f"({TIME_SHARE:.0%} of the search's time, or "
                                f"{MIN_TIME_S:.0f} s)"})
            continue
        quiet = UNMET_PINS_LEVEL.set(logging.DEBUG)     # not the user's method: no warnings
        alone = SHARE_COPIES.set(False)                 # the plain ILP only (`copies`)
        try:
            got = plan_with(rival)
        except InvalidArgumentError as e:    # the rival's rules do not fit this step (a batch
            out.append({**record(name, "method", None, 0.0, budget, what), "fits": None,
                        "peak_memory_bytes": None,       # that does not split over the mesh)
                        "note": f"{NOT_APPLICABLE}: {str(e).split('. Fix:')[0]}"})
            continue
        except InfeasiblePlanError as e:
            out.append(record(name, "method", None, e.needed_bytes, budget,
                              f"{what}; does not fit: needs {e.needed_bytes:.4g} bytes per "
                              f"device"))
            continue
        finally:
            UNMET_PINS_LEVEL.reset(quiet)
            SHARE_COPIES.reset(alone)
        out.append(record(name, "method", got.predicted_step_s, got.peak_memory_bytes, budget,
                          what))
    out.sort(key=lambda a: (a["predicted_step_s"] is None, a["predicted_step_s"] or 0.0))
    spent = time.perf_counter() - t0
    log.info("autopar: %d runner-up method(s) priced in %.2f s", len(out), spent)
    return dataclasses.replace(plan, alternatives=tuple(out),
                               timings_s={**plan.timings_s, "runner_ups": spent})

