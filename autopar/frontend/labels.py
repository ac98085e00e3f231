"""Labels for operators that have no name scope (Flax NNX modules add none): the parameter
each one consumes, e.g. `jvp()/Linear@model.layers[0].linear1.kernel`.

An operator consuming a parameter (directly or through a cast, transpose or reshape) is
labelled with that parameter's path and the class of the code calling it; a backward
operator that computes a parameter's gradient (it shares an input with the forward operator
of the same source line that consumed the parameter) gets the same label.

    >>> labels = operator_labels(graph)       # {node id: label}, nodes without a scope only
    >>> labels[0]
    'jvp()/Linear@model.linear1.kernel'
"""
from __future__ import annotations

import re

from autopar.core.graph import InputRole, Node, OpGraph, TensorKind

_PASS_THROUGH = frozenset({"convert_element_type", "transpose", "reshape", "copy", "copy_p",
                           "squeeze", "expand_dims", "broadcast_in_dim"})
_CALLER = re.compile(r"\(([\w.<>]+)\)$")


def unscoped(name_stack: str) -> bool:
    """True for a name stack with no module scope: "", "jvp()", "transpose(jvp())"."""
    return "/" not in name_stack and not re.sub(r"\w*\(|\)", "", name_stack)


def _param_of(graph: OpGraph, tid: int, depth: int = 4):
    for _ in range(depth):
        t = graph.tensors[tid]
        if t.kind == TensorKind.INPUT:
            return t if t.role == InputRole.PARAM else None
        if t.producer is None:
            return None
        prod = graph.nodes[t.producer]
        if prod.primitive not in _PASS_THROUGH or not prod.inputs:
            return None
        tid = prod.inputs[0]
    return None


def _label(node: Node, path: str) -> str:
    m = _CALLER.search(node.source)
    parts = [p for p in m.group(1).split(".") if p != "<locals>"] if m else [node.primitive]
    caller = parts[-2] if len(parts) > 1 else parts[0]      # the class of a method
    return (f"{node.name_stack}/" if node.name_stack else "") + f"{caller}@{path}"


def operator_labels(graph: OpGraph, nodes) -> dict[int, str]:
    """{node id: label} for the nodes of `nodes` without a module scope whose parameter can be
    found (see the module docstring)."""
    out: dict[int, str] = {}
    by_input: dict[tuple[int, str], str] = {}     # (non-parameter input, source) -> label
    todo = [n for n in nodes if unscoped(n.name_stack)]
    for node in todo:
        for tid in node.inputs:
            p = _param_of(graph, tid)
            if p is not None:
                out[node.id] = _label(node, p.path)
                for other in node.inputs:
                    if other != tid:
                        by_input.setdefault((other, node.source), p.path)
                break
    for node in todo:
        if node.id not in out:
            path = next((by_input[(t, node.source)] for t in node.inputs
                         if (t, node.source) in by_input), None)
            if path is not None:
                out[node.id] = _label(node, path)
    return out
