"""The one place autopar reaches into JAX internals or version-dependent names (of JAX, and of
PuLP: its 4.x release changed the CBC backend)."""
from __future__ import annotations

import jax
import jax.extend.core as jcore
from jax.extend import source_info_util
from jax.extend.core import primitives as prims

Var = jcore.Var
Literal = jcore.Literal
DropVar = jcore.DropVar
Jaxpr = jcore.Jaxpr
ClosedJaxpr = jcore.ClosedJaxpr
Tracer = jax.core.Tracer          # a value under a JAX transformation (jit, grad, vmap)

CLOSED_CALL = prims.closed_call_p.name    # "closed_call" up to jax 0.11, "eval_jaxpr" in 0.12
# Call-like primitives whose body is inlined by the trace pass, and the param holding the body.
INLINE_BODY_PARAM = {
    prims.jit_p.name: "jaxpr",
    prims.custom_jvp_call_p.name: "call_jaxpr",
    prims.custom_vjp_call_p.name: "call_jaxpr",
    prims.remat_p.name: "jaxpr",
    CLOSED_CALL: "call_jaxpr",    # e.g. a scan's body, differentiated under remat
}
SHARDING_CONSTRAINT = prims.sharding_constraint_p.name
REMAT = prims.remat_p.name


def scan_counts(params: dict) -> tuple[int, int]:
    """(consts, carries) among a `scan` equation's operands: `num_consts` / `num_carry` up to
    jax 0.11, the lengths of the first two groups of `ft_in` (consts, carry, xs) in 0.12."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()     # a flat tree of three groups
    return len(consts.vals) if hasattr(consts, "vals") else len(consts), \
        len(carry.vals) if hasattr(carry, "vals") else len(carry)

# Primitives that only say where a value lives (the param naming it): lowering re-emits them
# as the identity, the plan's constraints placing every value.
_PLACEMENT_PARAM = {SHARDING_CONSTRAINT: "sharding", "reshard": "dst_sharding",
                    "mesh_cast": "dst_sharding"}
# Params through which an operator states its result's sharding (explicit-sharding JAX).
_OUT_SHARDING_PARAMS = ("out_sharding", "sharding")


def annotation_of(eqn):
    """The sharding the user's code annotates this equation's result with (a
    `NamedSharding` or `PartitionSpec`), or None: `with_sharding_constraint`, `reshard`,
    `mesh_cast`, or an operator's `out_sharding=`, in the forward pass only (the backward's
    are JAX's transposes of them, not the user's)."""
    if "transpose(" in name_stack(eqn.source_info):
        return None
    key = _PLACEMENT_PARAM.get(eqn.primitive.name)
    if key is not None:
        return eqn.params.get(key)
    for key in _OUT_SHARDING_PARAMS:
        value = eqn.params.get(key)
        if value is not None and hasattr(value, "spec"):
            return value
    return None


def lowering_params(eqn) -> dict | None:
    """The params to re-emit `eqn` with under autopar's own (Auto-axis) shardings: None for a
    placement-only primitive (re-emitted as the identity), else the params with every
    result-sharding annotation cleared (it names the user's mesh and axis types; the plan's
    constraint places the result)."""
    if eqn.primitive.name in _PLACEMENT_PARAM:
        return None
    params = eqn.params
    if any(params.get(k) is not None for k in _OUT_SHARDING_PARAMS):
        params = {k: (None if k in _OUT_SHARDING_PARAMS else v) for k, v in params.items()}
    return params


def remat_barrier_operands(eqn, differentiated: bool | None = None) -> tuple[bool, ...]:
    """Which operands of a `remat` equation `jax.checkpoint`'s lowering puts behind an
    optimization barrier: those marked `prevent_cse` (a bool, or one per operand in newer
    JAX) of a differentiated remat (the recomputation inside the backward pass; pass
    `differentiated=True` for the ones its gradient will have)."""
    n = len(eqn.invars)
    if differentiated is None:
        differentiated = eqn.params.get("differentiated", False)
    if not differentiated:
        return (False,) * n
    prevent = eqn.params.get("prevent_cse", True)
    return tuple(prevent) if isinstance(prevent, (tuple, list)) else (bool(prevent),) * n


def barrier_eqn(aval, source_info):
    """A one-operand `optimization_barrier` equation (for a node of a remat's barrier group),
    attributed to `source_info`."""
    eqn = jax.make_jaxpr(jax.lax.optimization_barrier)(
        jax.ShapeDtypeStruct(aval.shape, aval.dtype)).eqns[0]
    return eqn.replace(source_info=source_info)


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


def is_explicit(mesh) -> bool:
    """Whether any axis of `mesh` is typed Explicit (`jax.make_mesh`'s default)."""
    types = getattr(mesh, "axis_types", None) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


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


