"""The user's sharding annotations as ILP pins: `with_sharding_constraint`,
`jax.sharding.reshard`, `mesh_cast`, and the `out_sharding=` of einsums, matmuls and array
constructors (explicit-sharding JAX), read off the traced graph.

`Annotations.PIN` (the default) keeps only the strategies that give an annotated value its
annotated sharding; `HINT` charges every other choice what moving the value into the annotated
layout would cost (the annotation wins ties and near-ties, not large gains); `IGNORE` plans as
if there were none. Lowering never re-emits an annotation: the plan's own constraints place
every value (see `frontend.interpret.run_nodes`).

Example:
    >>> pins = annotation_specs(graph, ("data", "model"), (2, 4))
    >>> {graph.tensors[t].shape: spec for t, spec in pins.items()}
    {(16, 64): ((0,), (1,))}
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from autopar.core import _compat
from autopar.core.errors import InvalidArgumentError
from autopar.core.graph import OpGraph
from autopar.core.spec import Spec, is_valid

log = logging.getLogger(__name__)


def _entries(sharding) -> tuple | None:
    """PartitionSpec entries of a NamedSharding / PartitionSpec annotation (None: none)."""
    spec = getattr(sharding, "spec", sharding)
    if spec is None or not hasattr(spec, "__iter__"):
        return None
    out = []
    for e in spec:
        if e is None or e is Ellipsis:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        else:
            out.append(tuple(e))
    return tuple(out)


def annotation_specs(graph: OpGraph, axis_names: Sequence[str], mesh_shape: Sequence[int],
                     *, strict: bool = True) -> dict[int, Spec]:
    """tensor id -> the sharding the user's code annotates it with (split ones only: under
    explicit axes JAX itself inserts replicated `reshard`s wherever a value's type is
    replicated, so a replicated annotation is not taken as the user's). With `strict`, an
    annotation that names an axis the mesh lacks or does not divide its dimension is an
    error; without (a pipeline stage's logical mesh, whose axes are not the user's), it is
    skipped and logged."""
    out: dict[int, Spec] = {}
    for node in graph.nodes:
        if not hasattr(node.eqn, "primitive"):      # a loop's boundary pseudo-node
            continue
        sharding = _compat.annotation_of(node.eqn)
        if sharding is None:
            continue
        entries = _entries(sharding)
        if entries is None or not node.outputs:
            continue
        tid = node.outputs[0]
        t = graph.tensors[tid]
        entries = entries + ((),) * (t.rank - len(entries))
        where = (f"the annotation {sharding!r} on the result of `{node.primitive}` at "
                 f"{node.source} (shape {t.shape})")
        unknown = [a for dim in entries for a in dim if a not in axis_names]
        spec = None if unknown else tuple(tuple(axis_names.index(a) for a in dim)
                                          for dim in entries[:t.rank])
        if spec is None or len(entries) > t.rank or not is_valid(spec, t.shape, mesh_shape):
            if not strict:
                log.info("autopar: %s does not apply to the mesh %s; not pinned", where,
                         dict(zip(axis_names, mesh_shape)))
                continue
            why = (f"names axis {unknown[0]!r}, which the mesh lacks" if unknown else
                   "does not divide the value's dimensions on this mesh")
            raise InvalidArgumentError(
                f"{where} {why} (mesh {dict(zip(axis_names, mesh_shape))}). Fix: annotate with "
                f"the mesh's axis names and sizes that divide, or plan with "
                f"annotations='ignore'.")
        if any(spec) and tid not in out:
            out[tid] = spec
    return out


def pin_rule(pins: dict[int, Spec]) -> Callable[..., bool] | None:
    """`allowed(tid, spec, wanted)`: an annotated value takes its annotated sharding (an
    operator may still read it in another layout, paying the move)."""
    if not pins:
        return None

    def allowed(tid: int, spec: Spec, wanted: bool = False) -> bool:
        want = pins.get(tid)
        return wanted or want is None or spec == want
    return allowed


def both(a: Callable[..., bool] | None, b: Callable[..., bool] | None):
    """The conjunction of two `allowed` rules (None: no rule)."""
    if a is None or b is None:
        return a or b
    return lambda tid, spec, wanted=False: a(tid, spec, wanted) and b(tid, spec, wanted)

