"""The one place autopar reaches into JAX internals or version-dependent names (of JAX, and of
PuLP: its 4.x release changed the CBC backend)."""
from __future__ import annotations

import warnings

import jax
import jax.extend.core as jcore
from jax.extend import source_info_util
from jax.extend.core import primitives as prims

from .errors import UnsupportedError

Var = jcore.Var
Literal = jcore.Literal
DropVar = jcore.DropVar
Jaxpr = jcore.Jaxpr
ClosedJaxpr = jcore.ClosedJaxpr
Tracer = jax.core.Tracer          # a value under a JAX transformation (jit, grad, vmap)

# Call-like primitives whose body is inlined by the trace pass, and the param holding the body.
INLINE_BODY_PARAM = {
    prims.jit_p.name: "jaxpr",
    prims.custom_jvp_call_p.name: "call_jaxpr",
    prims.custom_vjp_call_p.name: "call_jaxpr",
    prims.remat_p.name: "jaxpr",
}
SHARDING_CONSTRAINT = prims.sharding_constraint_p.name


def source_summary(source_info, depth: int = 12) -> str | None:
    """`file:line:col (function)` of the innermost frame that created an equation and is not
    inside an installed library (jax, flax, optax, ...): the model or step code a user wrote.
    None when every frame is library code (the caller then uses the enclosing call's)."""
    try:
        frames = source_info_util.summarize(source_info, num_frames=depth).splitlines()
    except Exception:  # source info is best-effort metadata
        return None
    for frame in reversed(frames):  # innermost last
        if ("site-packages" not in frame and "dist-packages" not in frame
                and frame != "unknown"):
            return frame
    return None


def name_stack(source_info) -> str:
    return str(getattr(source_info, "name_stack", "") or "")


def auto_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """The same devices and axis names with every axis typed Auto.

    `jax.make_mesh` defaults to Explicit axes, where a matmul over a sharded contracting
    dimension raises unless given `out_sharding`; autopar's lowering places shardings itself
    with `with_sharding_constraint`, which needs Auto axes.
    """
    AxisType = jax.sharding.AxisType
    types = getattr(mesh, "axis_types", None)
    if types is not None and all(t == AxisType.Auto for t in types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def equation_context(eqn):
    """Context manager that re-emits an equation under its original name stack and traceback,
    so HLO metadata says `transpose(jvp(MLP))/Dense_3/dot_general` and the user's line."""
    info = eqn.source_info
    return source_info_util.user_context(info.traceback, name_stack=info.name_stack)


def distributed_client():
    """The `jax.distributed` coordination-service client (key-value store, barriers, live
    processes), or None before `jax.distributed.initialize`."""
    from jax._src import distributed
    return distributed.global_state.client


def coordinator_address() -> str | None:
    from jax._src import distributed
    return distributed.global_state.coordinator_address


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


def cbc_solve(problem, **options):
    """Solve a `pulp.LpProblem` with CBC (`cbc_command(**options)`): (status, the solver's
    words for it), status a `SolveStatus`: OPTIMAL, FEASIBLE (a solution, a limit hit first),
    INFEASIBLE, or FALLBACK (no solution). PuLP < 4 leaves the outcome on the problem
    (`status`, `sol_status`); PuLP 4 returns it (`LpSolveStats`)."""
    import pulp

    from .intra_op.mip import SolveStatus
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


def cbc_available() -> bool:
    """Whether `cbc_command` finds a CBC binary."""
    try:
        cbc_command(msg=False)
    except UnsupportedError:
        return False
    return True
