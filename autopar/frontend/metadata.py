"""Sharding metadata on parameters, taken as pins (`annotations="pin"`, the default): Flax
NNX's `nnx.with_partitioning(...)` (a Variable's `out_sharding` / `sharding_names` metadata)
and linen's `nn.with_partitioning` / `nn.with_logical_partitioning` boxes (logical names
mapped to mesh axes by the box's rules or the `nn.logical_axis_rules` in effect at the call).

A leaf whose metadata names axes the step's mesh lacks (logical names without rules, or a
mesh of another shape) is not pinned; the log says so.

Example:
    >>> rules = metadata_rules(args, static=(), names=("model", "batch"), mesh=mesh)
    >>> rules
    (('^model\\.linear\\.kernel$', (None, 'model')),)
"""
from __future__ import annotations

import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from autopar.core.errors import InvalidArgumentError
from autopar.frontend.jit_options import check_pin
from autopar.frontend.nnx import NnxState

log = logging.getLogger(__name__)


def _nnx_entries(variable) -> tuple | None:
    get = getattr(variable, "get_metadata", None)
    meta = get() if get is not None else {}
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = meta.get(key)
        if names is not None and not hasattr(names, "mesh"):
            return tuple(names)
    return None


def _linen_boxes():
    linen = sys.modules.get("flax.linen")
    if linen is None:
        return ()
    return tuple(t for t in (getattr(linen, "Partitioned", None),
                             getattr(linen, "LogicallyPartitioned", None)) if t is not None)


def _linen_entries(box) -> tuple:
    from flax.linen import spmd
    names = tuple(box.names)
    if hasattr(box, "rules"):         # LogicallyPartitioned: logical names -> mesh axes
        rules = box.rules if box.rules is not None else spmd.get_logical_axis_rules()
        names = tuple(spmd.logical_to_mesh_axes(names, rules))
    return names


def _pin(entries: tuple, shape, mesh, where: str) -> bool:
    """Whether `entries` are a valid pin of a leaf of `shape` on `mesh` (`check_pin`: known
    axes, each once, splits that divide); if not, logged: metadata made for another mesh
    or logical names without rules are not the user's pins for this one."""
    try:
        check_pin(PartitionSpec(*entries), shape, mesh, f"the sharding metadata of `{where}`")
    except InvalidArgumentError as e:
        log.info("autopar: %s; not pinned", e)
        return False
    return True


def metadata_rules(args: Sequence[Any], static: Sequence[int], names: Sequence[str],
                   mesh: jax.sharding.Mesh) -> tuple[tuple[str, tuple], ...]:
    """One exact-path `sharding_rules` entry per argument leaf whose sharding metadata fits
    `mesh` (paths as the trace names them: the argument's name and the leaf's key path)."""
    rules = []
    boxes = _linen_boxes()
    for i, arg in enumerate(args):
        if i in static:
            continue
        if isinstance(arg, NnxState):
            values = iter(arg.values)
            keys = iter(arg.layout.keys)
            for _path, variable in arg.state_items():
                leaves = jax.tree_util.tree_leaves(variable)
                entries = _nnx_entries(variable)
                for _ in leaves:
                    value, key = next(values), next(keys)
                    where = names[i] + key.text
                    if entries is not None and len(leaves) == 1 \
                            and _pin(entries, jax.numpy.shape(value), mesh, where):
                        rules.append((f"^{re.escape(where)}$", entries))
            continue
        if not boxes:
            continue
        for path, box in jax.tree_util.tree_flatten_with_path(
                arg, is_leaf=lambda x: isinstance(x, boxes))[0]:
            if not isinstance(box, boxes):
                continue
            inner = jax.tree_util.tree_flatten_with_path(box)[0]
            if len(inner) != 1:
                continue
            where = names[i] + jax.tree_util.keystr(path) + jax.tree_util.keystr(inner[0][0])
            entries = _linen_entries(box)
            if _pin(entries, jax.numpy.shape(inner[0][1]), mesh, where):
                rules.append((f"^{re.escape(where)}$", entries))
    return tuple(rules)


__all__ = ["metadata_rules"]
