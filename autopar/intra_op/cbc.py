"""PuLP's CBC, as the intra-op MIP's second backend (`mip.solve_cbc`): the command (PuLP 3
bundles a CBC binary, PuLP 4 does not) and the outcome of a solve in PuLP 3's and 4's words.
No JAX here."""
from __future__ import annotations

import warnings

from autopar.core.enums import SolveStatus
from autopar.core.errors import UnsupportedError


def cbc_solve(problem, **options):
    """Solve a `pulp.LpProblem` with CBC (`cbc_command(**options)`): (status, the solver's
    words for it), status a `SolveStatus`: OPTIMAL, FEASIBLE (a solution, a limit hit first),
    INFEASIBLE, or FALLBACK (no solution). PuLP < 4 leaves the outcome on the problem
    (`status`, `sol_status`); PuLP 4 returns it (`LpSolveStats`)."""
    import pulp

    stats = problem.solve(cbc_command(**options))
    if not hasattr(pulp, "LpSolveStats"):                 # PuLP < 4
        words = pulp.LpStatus.get(problem.status, str(problem.status))
        if (problem.status == pulp.LpStatusInfeasible
                or problem.sol_status == pulp.LpSolutionInfeasible):
            return SolveStatus.INFEASIBLE, words
        return {pulp.LpSolutionOptimal: SolveStatus.OPTIMAL,
                pulp.LpSolutionIntegerFeasible: SolveStatus.FEASIBLE}.get(
                    problem.sol_status, SolveStatus.FALLBACK), words
    words = stats.status.name
    if stats.status == pulp.LpSolveStatus.Infeasible:
        return SolveStatus.INFEASIBLE, words
    if not stats.has_solution:
        return SolveStatus.FALLBACK, words
    # GapLimit: optimal up to the gap asked for (PuLP < 4 called that optimal too)
    optimal = stats.status in (pulp.LpSolveStatus.Optimal, pulp.LpSolveStatus.GapLimit)
    return (SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE), words


def cbc_command(**options):
    """PuLP's command that runs CBC, with `options` (msg, timeLimit, gapRel, ...).

    PuLP < 4 bundles a CBC binary (`PULP_CBC_CMD`); PuLP 4 dropped it: `COIN_CMD` runs the
    binary of the `cbcbox` package (`pip install 'pulp[cbc]'`) or a `cbc` on PATH.

    Example:
        >>> cmd = cbc_command(msg=False, timeLimit=10.0)   # then `problem.solve(cmd)`

    Raises:
      UnsupportedError: PuLP 4 finds no CBC binary.
    """
    import pulp
    if hasattr(pulp, "PULP_CBC_CMD"):
        with warnings.catch_warnings():   # PuLP 3.3 deprecates PULP_CBC_CMD for 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(**options)
    cmd = pulp.COIN_CMD(**options)
    if not cmd.available():
        raise UnsupportedError(
            f"solver=SolverBackend.CBC: PuLP {pulp.__version__} bundles no CBC binary (PuLP 4 "
            f"dropped it) and none was found (neither the `cbcbox` package nor `cbc` on PATH). "
            f"Fix: pip install 'pulp[cbc]' (or install a `cbc`, e.g. Debian's coinor-cbc), or "
            f"use solver=SolverBackend.HIGHS.")
    return cmd


def cbc_available() -> bool:
    """Whether `cbc_command` finds a CBC binary."""
    try:
        cbc_command(msg=False)
    except UnsupportedError:
        return False
    return True
