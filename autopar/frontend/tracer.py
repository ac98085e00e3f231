"""Trace pass: a Python function and example arguments -> `OpGraph`.

The function is traced once with `jax.make_jaxpr`; call-like primitives (`jit`,
`custom_jvp_call`, `custom_vjp_call`, `remat`) are inlined so that every heavy operator is a
node of one flat graph. Control flow (`scan`, `while`, `cond`) becomes a region: its body's
operators are nodes too, connected by pseudo-nodes (`frontend.loops`).

Example:
    >>> graph = trace(lambda w, x: jnp.tanh(x @ w), (w, x), batch_argnums=(1,))
    >>> [n.primitive for n in graph.nodes]
    ['dot_general', 'tanh']
"""
from __future__ import annotations

import functools
import inspect
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from autopar.core import _compat, progress
from autopar.core.errors import InvalidArgumentError
from autopar.core.graph import (
    InputRole,
    Node,
    OpGraph,
    RematRegion,
    StageMarker,
    Tensor,
    TensorKind,
)
from autopar.core.primitives import ARITHMETIC, REDUCTION_FLOPS, WINDOW_REDUCTIONS, WINDOW_SELECTS
from autopar.frontend.checks import arg_names as _arg_names
from autopar.frontend.checks import argnums_text, check_array_tree, check_leaves, check_primitive
from autopar.frontend.checks import dtype_name as _dtype_name
from autopar.frontend.grad import VALUE_AND_GRAD
from autopar.frontend.grad import expand as _expand_marker
from autopar.frontend.loops import REGION_PRIMITIVES, trace_region
from autopar.frontend.markers import STAGE_BOUNDARY

# Path components that mark optimizer state (optax's state names and common container names).
_OPT_STATE_PATTERN = re.compile(
    r"opt_state|\boptimizer\b|\.opt\b|\['opt'\]|\bmu\b|\bnu\b|momentum|\btrace\b|\bema\b|"
    r"v_row|v_col|\bvr\b|\bvc\b|\bacc\b|accumulator", re.IGNORECASE)

def node_flops(primitive: str, eqn) -> float:
    """Floating-point operations of one equation (2 per multiply-add)."""
    outs = [v.aval for v in eqn.outvars]
    ins = [v.aval for v in eqn.invars]
    if primitive == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        contract = math.prod(ins[0].shape[d] for d in lc)
        return 2.0 * math.prod(outs[0].shape) * contract
    if primitive == "conv_general_dilated":
        rhs = ins[1].shape
        dn = eqn.params["dimension_numbers"]
        rhs_spec = dn.rhs_spec  # (out_feature, in_feature, *spatial)
        per_out = math.prod(rhs[d] for d in rhs_spec[1:])
        return 2.0 * math.prod(outs[0].shape) * per_out
    if primitive in ARITHMETIC:
        return float(math.prod(getattr(outs[0], "shape", ())))
    if primitive in REDUCTION_FLOPS:
        return float(math.prod(getattr(ins[0], "shape", ())))
    if primitive in WINDOW_REDUCTIONS or primitive in WINDOW_SELECTS:
        # One op per window element of every pooled element: the results of a reduce_window
        # (one per operand) or a select_and_gather_add, the source of a select_and_scatter*.
        window = math.prod(eqn.params["window_dimensions"])
        source = {"select_and_scatter_add": 0, "select_and_scatter": 1}.get(primitive)
        pooled = outs[0] if source is None else ins[source]
        return float(math.prod(pooled.shape) * window * len(outs))
    return 0.0


def classify_input(path: str, dtype: str, is_batch: bool) -> InputRole:
    """Role of a flat input leaf, from its argument and tree path."""
    if is_batch:
        return InputRole.BATCH
    if not (dtype.startswith("float") or dtype.startswith("bfloat") or dtype.startswith("complex")):
        return InputRole.OTHER
    if _OPT_STATE_PATTERN.search(path):
        return InputRole.OPT_STATE
    return InputRole.PARAM


def check_argnums(name: str, argnums: Sequence[int], num_args: int) -> tuple[int, ...]:
    out = []
    for a in argnums:
        if not isinstance(a, int) or not -num_args <= a < num_args:
            raise InvalidArgumentError(
                f"{argnums_text(name, argnums)}: {a!r} is not a valid positional argument index "
                f"for a call with {num_args} argument(s). Fix: pass indices in [0, {num_args}).")
        out.append(a % num_args)
    return tuple(sorted(set(out)))


def bind_arguments(fun: Callable, args: tuple, kwargs: dict) -> tuple:
    """`args` with `kwargs` bound to their positions through `fun`'s signature, as `jax.jit`
    binds them (defaults are not filled in: an argument not passed is not passed).

    Raises:
      InvalidArgumentError: a keyword the signature does not take by position (keyword-only
        parameters, **kwargs), or arguments that do not fit the signature.
    """
    if not kwargs:
        return args
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    bound = list(args)
    for name, value in kwargs.items():
        if name not in names or (names.index(name) < len(args)):
            why = ("is also passed by position" if name in names
                   else "is not one of its positional parameters " + str(names))
            raise InvalidArgumentError(
                f"{getattr(fun, '__name__', 'the step')}() got keyword argument {name!r}, which "
                f"{why}. "
                "Fix: pass it by position, or make it a positional parameter (keyword-only "
                "parameters and **kwargs are not supported by parallelize).")
        i = names.index(name)
        bound += [_MISSING] * (i + 1 - len(bound))
        bound[i] = value
    if any(v is _MISSING for v in bound):
        missing = [names[i] for i, v in enumerate(bound) if v is _MISSING]
        raise InvalidArgumentError(
            f"{getattr(fun, '__name__', 'the step')}(): the parameters {missing} before the ones "
            "passed by keyword were not passed. Fix: pass them (by position or keyword).")
    return tuple(bound)


_MISSING = object()


def check_donated_aliases(fun: Callable, args: Sequence[Any], static_argnums: Sequence[int],
                          donate_argnums: Sequence[int]) -> None:
    """A donated array must not be passed anywhere else in the same call (in another argument,
    or twice in the donated one): the step would read a buffer it has handed over, and XLA:CPU
    crashes the process. Cheap enough for every call: one dict lookup per array leaf, by
    object identity; leaf paths are looked up only to report a clash.

    Example:
        >>> check_donated_aliases(step, (params, params, batch), (), (0,))
        InvalidArgumentError: donate_argnums=(0,): the array at argument 0 (`p`)['w'] is ...

    Raises:
      InvalidArgumentError: naming both places and the fix.
    """
    if not donate_argnums:
        return
    donate_argnums = check_argnums("donate_argnums", donate_argnums, len(args))
    static_argnums = check_argnums("static_argnums", static_argnums, len(args))
    seen: dict[int, int] = {}          # id of an array leaf -> argument of its first use
    for i, a in enumerate(args):
        if i in static_argnums:
            continue
        for x in jax.tree_util.tree_leaves(a):
            if not isinstance(x, jax.Array):
                continue
            j = seen.get(id(x))
            if j is None:
                seen[id(x)] = i
            elif i in donate_argnums or j in donate_argnums:
                raise _aliased_donation(fun, args, static_argnums, donate_argnums, x)


def _aliased_donation(fun, args, static_argnums, donate_argnums, x) -> InvalidArgumentError:
    names = _arg_names(fun, len(args))
    where = [(i, f"argument {i} (`{names[i]}`){jax.tree_util.keystr(path)}")
             for i, a in enumerate(args) if i not in static_argnums
             for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0] if leaf is x]
    arg, donated = next((i, w) for i, w in where if i in donate_argnums)
    other = next(w for _, w in where if w != donated)
    return InvalidArgumentError(
        f"donate_argnums={tuple(donate_argnums)}: the array at {donated} is donated, and the "
        f"same array is also passed as {other} (shape {tuple(x.shape)}, {x.dtype}); the step "
        f"would read a buffer it has already handed over (on CPU the process crashes). Fix: "
        f"pass a copy in one of the places (e.g. `jax.tree.map(jnp.copy, tree)`), or do not "
        f"donate argument {arg}.")


class _Builder:
    """Accumulates tensors and nodes while walking (nested) jaxprs."""

    def __init__(self, keep_grad: bool = False):
        self.keep_grad = keep_grad      # keep `autopar.value_and_grad` as one node (pipelines)
        self.tensors: list[Tensor] = []
        self.nodes: list[Node] = []
        self.const_values: dict[int, Any] = {}
        self.markers: list[StageMarker] = []
        self.region: RematRegion | None = None   # the undifferentiated remat being walked
        self.regions: list = []         # LoopRegion per scan / while / cond (frontend.loops)

    def new_tensor(self, aval, kind: TensorKind, **kw) -> int:
        tid = len(self.tensors)
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = _dtype_name(aval)
        if dtype == "key":
            kw["key_dtype"] = aval.dtype
        self.tensors.append(Tensor(id=tid, shape=shape, dtype=dtype, kind=kind, **kw))
        return tid

    def const(self, value, aval) -> int:
        tid = self.new_tensor(aval, TensorKind.CONST)
        self.const_values[tid] = value
        return tid

    def read(self, env: dict, atom) -> int:
        if isinstance(atom, _compat.Literal):
            return self.const(atom.val, atom.aval)
        return env[atom]

    def walk(self, jaxpr, env: dict, outer_source: str | None = None) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            in_ids = [self.read(env, v) for v in eqn.invars]
            if name == STAGE_BOUNDARY:   # identity: alias the values, remember the boundary
                for outer, tid in zip(eqn.outvars, in_ids):
                    env[outer] = tid
                self.markers.append(StageMarker(
                    position=len(self.nodes), name=eqn.params["name"],
                    backward="transpose(" in _compat.name_stack(eqn.source_info)))
                continue
            if name in REGION_PRIMITIVES:
                trace_region(self, eqn, in_ids, env, outer_source)
                continue
            check_primitive(name, eqn, outer_source)
            body_param = _compat.INLINE_BODY_PARAM.get(name)
            if name == VALUE_AND_GRAD and not self.keep_grad:
                body = jax.make_jaxpr(functools.partial(_expand_marker, **eqn.params))(
                    *(v.aval for v in eqn.invars))
            elif body_param is not None:
                body = eqn.params[body_param]
            else:
                body = None
            if body is not None:
                region = self.region
                if name == _compat.REMAT:
                    in_ids = self.remat_barrier(eqn, in_ids, outer_source)
                    if not eqn.params.get("differentiated", False) and region is None:
                        self.region = RematRegion(
                            id=len(self.nodes), policy=eqn.params.get("policy"),
                            prevent_cse=any(_compat.remat_barrier_operands(eqn, True)))
                inner = getattr(body, "jaxpr", body)
                consts = getattr(body, "consts", ())
                inner_env = {}
                for v, c in zip(inner.constvars, consts):
                    inner_env[v] = self.const(c, v.aval)
                inner_env.update(zip(inner.invars, in_ids))
                self.walk(inner, inner_env, _compat.source_summary(eqn.source_info)
                          or outer_source)
                self.region = region
                for outer, inner_out in zip(eqn.outvars, inner.outvars):
                    if not isinstance(outer, _compat.DropVar):
                        env[outer] = self.read(inner_env, inner_out)
                continue
            for v, tid in zip(eqn.outvars, self.add_node(eqn, in_ids, outer_source)):
                if not isinstance(v, _compat.DropVar):
                    env[v] = tid

    def add_node(self, eqn, in_ids, outer_source, *, barrier: int | None = None) -> list[int]:
        """Add a node for `eqn` reading `in_ids`; returns its result tensors, in order."""
        name = eqn.primitive.name
        node_id = len(self.nodes)
        out_ids = []
        for v in eqn.outvars:
            out_ids.append(self.new_tensor(v.aval, TensorKind.INTERMEDIATE, producer=node_id))
        self.nodes.append(Node(
            id=node_id, primitive=name, inputs=tuple(in_ids), outputs=tuple(out_ids),
            flops=node_flops(name, eqn),
            source=_compat.source_summary(eqn.source_info) or outer_source or "<unknown>",
            name_stack=_compat.name_stack(eqn.source_info), eqn=eqn, barrier=barrier,
            remat=self.region))
        return out_ids

    def remat_barrier(self, eqn, in_ids: list[int], outer_source) -> list[int]:
        """The operands of a differentiated `remat` (the recomputation in the backward pass)
        pass through an optimization barrier, as `jax.checkpoint` lowers them, so that XLA
        does not merge the recomputation with the forward pass (common-subexpression
        elimination would undo the rematerialization). One node per operand, one group."""
        keep = _compat.remat_barrier_operands(eqn)
        if not any(keep):
            return in_ids
        group = len(self.nodes)
        out = list(in_ids)
        for i, tid in enumerate(in_ids):
            if keep[i]:
                out[i] = self.add_node(_compat.barrier_eqn(eqn.invars[i].aval,
                                                           eqn.source_info), [tid],
                                       outer_source, barrier=group)[0]
        return out


@progress.timed("trace", lambda g: f"{len(g.nodes)} operators, {len(g.tensors)} tensors")
def trace(fun: Callable, args: Sequence[Any], *, static_argnums: Sequence[int] = (),
          batch_argnums: Sequence[int] = (), donate_argnums: Sequence[int] = (),
          keep_grad: bool = False) -> OpGraph:
    """Trace `fun(*args)` into an `OpGraph`.

    `args` may hold concrete arrays or `jax.ShapeDtypeStruct`s. Static arguments are closed
    over; the graph's inputs are the leaves of the remaining arguments, in order. With
    `keep_grad`, an `autopar.value_and_grad` stays one node (its loss jaxpr in `eqn.params`)
    instead of being expanded into forward and backward operators.
    """
    start = time.perf_counter()
    args = tuple(args)
    static = check_argnums("static_argnums", static_argnums, len(args))
    batch = check_argnums("batch_argnums", batch_argnums, len(args))
    donate = check_argnums("donate_argnums", donate_argnums, len(args))
    clash = set(static) & (set(batch) | set(donate))
    if clash:
        raise InvalidArgumentError(
            f"argument(s) {sorted(clash)} are listed in static_argnums and also in batch_argnums "
            f"or donate_argnums; a static argument is not an array. Fix: remove them from one.")
    dyn_idx = [i for i in range(len(args)) if i not in static]
    names = _arg_names(fun, len(args))
    check_leaves(fun, args, static)

    def flat_fun(*dyn_args):
        full = list(args)
        for i, a in zip(dyn_idx, dyn_args):
            full[i] = a
        out = fun(*full)
        check_array_tree(out, f"{getattr(fun, '__name__', 'the step')} returned a value whose",
                         "return arrays (and pytrees of them) only; keep other values out of "
                         "the step's result (e.g. compute them outside the step).")
        return out

    dyn_args = tuple(args[i] for i in dyn_idx)
    # Trace shapes and dtypes only: where the arguments live must not change the graph (a
    # committed, sharded argument would add `reshard` equations under `jax.grad`).
    abstract = jax.tree_util.tree_map(_abstract, dyn_args)
    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*abstract)
    leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path(dyn_args)
    out_tree = jax.tree_util.tree_structure(out_shape)

    b = _Builder(keep_grad)
    env: dict = {}
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        env[v] = b.const(c, v.aval)
    input_ids, arg_of_input, donated = [], [], set()
    for pos, ((path, _), var) in enumerate(zip(leaves_with_paths, closed.jaxpr.invars)):
        arg = dyn_idx[path[0].idx]
        path_str = names[arg] + jax.tree_util.keystr(path[1:])
        dtype = _dtype_name(var.aval)
        tid = b.new_tensor(var.aval, TensorKind.INPUT, input_index=pos, path=path_str,
                           role=classify_input(path_str, dtype, arg in batch))
        env[var] = tid
        input_ids.append(tid)
        arg_of_input.append(arg)
        if arg in donate:
            donated.add(pos)
    b.walk(closed.jaxpr, env)
    output_ids = [b.read(env, v) for v in closed.jaxpr.outvars]
    carried = carried_outputs(dyn_args, out_shape, [dyn_idx.index(i) for i in dyn_idx
                                                    if i not in batch])
    return OpGraph(nodes=tuple(b.nodes), tensors=tuple(b.tensors), inputs=tuple(input_ids),
                   outputs=tuple(output_ids), const_values=b.const_values, in_tree=in_tree,
                   out_tree=out_tree, arg_of_input=tuple(arg_of_input),
                   donated_inputs=frozenset(donated), carried_outputs=carried,
                   stage_markers=tuple(b.markers), regions=tuple(b.regions),
                   trace_time_s=time.perf_counter() - start)


def _abstract(x):
    """Shape and dtype of an argument leaf, without its placement. A Python int or bool (a
    `TrainState.step` starts as one) counts as a strong int32/bool array, so the first step and
    the ones after it, which get arrays back, share one plan."""
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
        return x
    weak = getattr(x, "weak_type", isinstance(x, (float, complex)))
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), weak_type=weak)


def abstract_signature(x) -> tuple:
    """(shape, numpy dtype, weak type) of a leaf: the key a decorated step's plans are cached
    under. Built for every leaf on every call, so the common case is kept cheap (the dtype
    object itself: numpy computes `dtype.name` in Python)."""
    if isinstance(x, jax.Array):
        try:
            return (x.shape, x.dtype, x.weak_type)
        except AttributeError:          # a typed key array has no weak type
            return (x.shape, x.dtype, False)
    a = _abstract(x)
    return (tuple(a.shape), a.dtype, bool(a.weak_type))


def _leaf_sig(x) -> tuple:
    return (tuple(np.shape(x)), str(jax.numpy.result_type(x)))


def carried_outputs(dyn_args: tuple, out_shape, state_args: Sequence[int]) -> dict[int, int]:
    """Pair result leaves with the argument leaves they replace: a result (or an element of a
    tuple/list result) with the same tree structure, shapes and dtypes as a state argument is
    that argument's next value (`state = step(state, batch)`)."""
    tu = jax.tree_util
    offsets, start = [], 0
    for a in dyn_args:
        n = len(tu.tree_leaves(a))
        offsets.append(start)
        start += n
    candidates = [(out_shape, 0)]
    if isinstance(out_shape, (tuple, list)):
        pos = 0
        for element in out_shape:
            candidates.append((element, pos))
            pos += len(tu.tree_leaves(element))
    pairs: dict[int, int] = {}
    used: set[int] = set()
    for i in state_args:
        arg = dyn_args[i]
        in_def, in_leaves = tu.tree_structure(arg), tu.tree_leaves(arg)
        if not in_leaves:
            continue
        for c, (sub, out_off) in enumerate(candidates):
            if c not in used and (tu.tree_structure(sub) == in_def
                    and [_leaf_sig(x) for x in tu.tree_leaves(sub)]
                    == [_leaf_sig(x) for x in in_leaves]):
                for k in range(len(in_leaves)):
                    pairs.setdefault(out_off + k, offsets[i] + k)
                used.add(c)
                break
    return pairs
