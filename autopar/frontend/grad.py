"""`autopar.grad` / `autopar.value_and_grad`: drop-in replacements for JAX's that mark where
the gradient is taken.

Outside autopar they compute exactly what `jax.grad` / `jax.value_and_grad` compute (the marker
is a primitive whose implementation and lowering *are* `jax.value_and_grad`). Under
`PipeshardParallel` the marker tells autopar which part of the step is the loss (split into
microbatches and pipelined over stages, forward and backward) and which part applies the
gradients (run once per step, per stage).

Example:
    >>> def train_step(state, batch):
    ...     def loss_fn(params):
    ...         return mse(state.apply_fn(params, batch["x"]), batch["y"])
    ...     loss, grads = autopar.value_and_grad(loss_fn)(state.params)
    ...     return state.apply_gradients(grads=grads), loss

Under `jax.vmap` and differentiation (`jax.jvp`, `jax.hessian`) the marker turns into what
it computes, so per-example gradients and gradient penalties work, unmarked.

With microbatches (`num_microbatches > 1`: gradient accumulation, pipelines) the loss runs
on B / M examples at a time and each of its outputs is combined back into the full batch's
as its graph shows it reduces the batch (`inter_op/reduction.py`):

- a mean over examples (`jnp.mean(ce)`, plus terms without the batch such as weight decay):
  the microbatches' mean, gradients too;
- a sum over examples (`jnp.sum(per_example)`): the sum, gradients too;
- `sum(l * w) / den` with `den` a scalar computed from the batch alone (a padded token loss:
  `sum(w)`, `jnp.maximum(sum(w), 1)`, `sum(w) + eps`, a count built with `jnp.where`): each
  microbatch weighted by its share of the whole batch's denominator, so the loss is the full
  batch's ratio and the gradient sum_m grad(num_m) / den exactly; a microbatch whose
  denominator is 0 adds nothing;
- an auxiliary output with the batch dimension (logits, per-example losses): the rows of all
  microbatches, in batch order;
- anything else (`exp(mean)`, a max over the batch, a denominator that depends on the
  parameters, statistics mixing examples): averaged (integers summed), with a
  `MicrobatchReductionWarning` naming the output, its line and the fix.

Random bits the loss draws with the batch dimension (dropout masks) are, in microbatch m,
exactly its rows of the whole batch's draw (under JAX's default partitionable threefry,
`inter_op/random_rows.py`), whatever the key (typed or raw; an argument, the state, a
closure): a step with dropout equals `jax.jit`'s. Where that cannot be shown (the flag off,
another PRNG, a draw over examples x examples), the keys are folded with the microbatch's
index (`jax.random.fold_in(key, m)`, other masks) and a `MicrobatchReductionWarning` says
why.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.extend.core as jcore
from jax.interpreters import ad, batching, mlir

from autopar.core.errors import InvalidArgumentError
from autopar.frontend.filter_grad import has_static_leaves, value_and_grad_filtered

value_and_grad_p = jcore.Primitive("autopar_value_and_grad")
value_and_grad_p.multiple_results = True
VALUE_AND_GRAD = value_and_grad_p.name


def expand(*flat_args, jaxpr: jcore.ClosedJaxpr, num_diff: int, has_aux: bool,
           num_params: int = 0):
    """What the marker computes: (loss, *aux leaves, *gradient leaves) of `jaxpr` with
    respect to its first `num_diff` inputs. A forward-only mark (`forward_marked`) has
    `num_diff` = 0: its outputs are the jaxpr's, and its first `num_params` inputs are the
    model's state (held by the pipeline stage that reads them, not differentiated)."""
    return value_and_grad_of(jcore.jaxpr_as_fun(jaxpr), flat_args, num_diff)


def value_and_grad_of(fun: Callable, flat_args, num_diff: int) -> tuple:
    """(loss, *aux, *gradient leaves) of `fun(*flat_args)` (loss first, then aux) with respect
    to its first `num_diff` arguments; with none (a forward-only mark) its outputs alone."""
    if num_diff == 0:
        return tuple(fun(*flat_args))
    rest = flat_args[num_diff:]

    def loss_of(*diff):
        outs = fun(*diff, *rest)
        return outs[0], tuple(outs[1:])

    (loss, aux), grads = jax.value_and_grad(loss_of, argnums=tuple(range(num_diff)),
                                           has_aux=True)(*flat_args[:num_diff])
    return (loss, *aux, *grads)


def _abstract_eval(*avals, jaxpr, num_diff, has_aux, num_params=0):
    return (*jaxpr.out_avals, *(a.update(weak_type=False) if hasattr(a, "update") else a
                                for a in avals[:num_diff]))


def _batch(args, dims, **params):
    """vmap of the marker is vmap of what it computes: the mark is dropped (a vmapped
    gradient, e.g. per-example gradients, is not a training step's loss)."""
    in_axes = [d if isinstance(d, int) else None for d in dims]     # None: not mapped
    outs = jax.vmap(functools.partial(expand, **params), in_axes=in_axes)(*args)
    return outs, [0] * len(outs)


def _jvp(primals, tangents, **params):
    """Differentiating the marker (a Hessian-vector product, a gradient penalty)
    differentiates what it computes; the mark is dropped."""
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(functools.partial(expand, **params), tuple(primals), tuple(tangents))


value_and_grad_p.def_impl(expand)
value_and_grad_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(value_and_grad_p, mlir.lower_fun(expand, multiple_results=True))
batching.primitive_batchers[value_and_grad_p] = _batch
ad.primitive_jvps[value_and_grad_p] = _jvp


def _closure_converted(fun: Callable, args: tuple) -> tuple[jcore.ClosedJaxpr, list]:
    """Trace `fun(*args)`; values it closes over (e.g. the batch, as tracers of the enclosing
    step) become trailing inputs. Returns (jaxpr over args then closed-over values, those
    values)."""
    closed = jax.make_jaxpr(fun)(*args)
    inner = closed.jaxpr
    open_jaxpr = jcore.Jaxpr(constvars=(), invars=[*inner.invars, *inner.constvars],
                             outvars=inner.outvars, eqns=inner.eqns, effects=inner.effects,
                             debug_info=inner.debug_info)
    return jcore.ClosedJaxpr(open_jaxpr, ()), list(closed.consts)


def _check_argnums(argnums, num_args: int) -> tuple[int, ...]:
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)
    if not nums or any(not isinstance(a, int) or not -num_args <= a < num_args for a in nums):
        raise InvalidArgumentError(
            f"autopar.value_and_grad: argnums={argnums!r} is not valid for a call with "
            f"{num_args} positional argument(s). Fix: pass an int or a tuple of ints in "
            f"[0, {num_args}).")
    return tuple(a % num_args for a in nums)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """Like `jax.value_and_grad(fun, argnums, has_aux)`, and marks the gradient for autopar.
    Differentiated NNX modules are taken as `nnx.value_and_grad` takes them (gradients of
    their `nnx.Param`s, as an `nnx.State`; see `autopar.frontend.nnx_grad`), and pytrees with
    non-array leaves (Equinox modules) as `eqx.filter_value_and_grad` takes them (gradients of
    their floating arrays, None elsewhere; see `autopar.frontend.filter_grad`).

    Under gradient accumulation or a pipeline the loss and aux are combined over microbatches
    as the module docstring says: exact for a mean, a sum or a padding-weighted ratio of sums
    over examples, aux with the batch dimension concatenated back in batch order, a
    `MicrobatchReductionWarning` otherwise.

    Example:
        >>> loss, grads = autopar.value_and_grad(loss_fn)(params, batch)
        >>> (loss, metrics), grads = autopar.value_and_grad(loss_fn, has_aux=True)(params)
        >>> loss, grads = autopar.value_and_grad(nnx_loss_fn)(model, batch)
        >>> loss, grads = autopar.value_and_grad(eqx_loss_fn)(eqx_model, x, y)
        >>> def padded_loss(params):      # exact with num_microbatches=M, logits full-batch
        ...     logits = model.apply(params, batch["inputs"])
        ...     w = jnp.where(batch["targets"] > 0, 1.0, 0.0)
        ...     ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        ...     return jnp.sum(ce * w) / jnp.sum(w), logits
    """
    marked = _marked(fun, argnums, has_aux)

    @functools.wraps(fun)
    def wrapped(*args):
        nums = _check_argnums(argnums, len(args))
        from autopar.frontend.nnx import holds_graph_nodes  # (frontend imports trace, grad)
        if any(holds_graph_nodes(args[i]) for i in nums):
            from autopar.frontend.nnx_grad import value_and_grad_nnx
            return value_and_grad_nnx(_marked, fun, argnums, nums, has_aux, args)
        if has_static_leaves(args, nums):     # an Equinox module: eqx.filter_value_and_grad's
            return value_and_grad_filtered(_marked, fun, argnums, nums, has_aux, args)
        return marked(*args)

    return wrapped


def _marked(fun: Callable, argnums, has_aux: bool):
    """`value_and_grad` on pytrees: the marker primitive around the loss's jaxpr."""
    def wrapped(*args):
        nums = _check_argnums(argnums, len(args))
        tu = jax.tree_util
        diff_args = tuple(args[i] for i in nums)
        other = tuple(a for i, a in enumerate(args) if i not in nums)
        diff_leaves, diff_tree = tu.tree_flatten(diff_args)
        other_leaves, other_tree = tu.tree_flatten(other)

        aux_tree = None

        def flat_fun(*leaves):
            """The loss on flat leaves -> (loss, *aux leaves); remembers the aux tree."""
            nonlocal aux_tree
            d = tu.tree_unflatten(diff_tree, leaves[:len(diff_leaves)])
            o = list(tu.tree_unflatten(other_tree, leaves[len(diff_leaves):]))
            by_pos = dict(zip(nums, d))
            out = fun(*(by_pos[i] if i in by_pos else o.pop(0) for i in range(len(args))))
            if not has_aux:
                return (out,)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise InvalidArgumentError(
                    "autopar.value_and_grad(has_aux=True): the function must return a pair "
                    f"(loss, aux), got {type(out).__name__}. Fix: return (loss, aux).")
            aux_leaves, aux_tree = tu.tree_flatten(out[1])
            return (out[0], *aux_leaves)

        jaxpr, consts = _closure_converted(flat_fun, (*diff_leaves, *other_leaves))
        loss_aval = jaxpr.out_avals[0]
        if getattr(loss_aval, "shape", None) != () or not jax.numpy.issubdtype(
                loss_aval.dtype, jax.numpy.floating):
            raise InvalidArgumentError(
                f"autopar.value_and_grad: the loss of `{getattr(fun, '__name__', fun)}` must be "
                f"a float scalar, got {loss_aval}. Fix: return a scalar (e.g. the batch mean).")
        outs = value_and_grad_p.bind(*diff_leaves, *other_leaves, *consts, jaxpr=jaxpr,
                                     num_diff=len(diff_leaves), has_aux=has_aux)
        n_aux = len(jaxpr.out_avals) - 1
        loss, aux = outs[0], outs[1:1 + n_aux]
        grads = tu.tree_unflatten(diff_tree, outs[1 + n_aux:])
        grads = grads[0] if isinstance(argnums, int) else grads
        value = (loss, tu.tree_unflatten(aux_tree, aux)) if has_aux else loss
        return value, grads

    return wrapped


def forward_marked(fun: Callable, batch_argnums: Sequence[int]) -> Callable:
    """`fun` with its whole body in a forward-only mark (no gradient): what a pipeline of a
    step without `autopar.value_and_grad` (an eval step, a batched forward) plans, as it
    plans a loss. The mark's inputs are the floating leaves of the arguments outside
    `batch_argnums` first (the model's state: `num_params` of them), then every other traced
    leaf, then the values `fun` closes over; its outputs are `fun`'s leaves. Arguments that
    are not traced (static ones) are closed over.

    Example:
        >>> marked = forward_marked(eval_step, batch_argnums=(1,))   # eval_step(params, batch)
        >>> logits, loss = marked(params, batch)      # the same values, one mark around them
    """
    @functools.wraps(fun)
    def wrapped(*args):
        batch = {a % len(args) for a in batch_argnums}      # negative argnums count too
        tu = jax.tree_util
        leaves, tree = tu.tree_flatten(args)
        owner = [i for i, a in enumerate(args) for _ in tu.tree_leaves(a)]
        traced = [k for k, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
        is_param = lambda k: owner[k] not in batch and jax.numpy.issubdtype(
            leaves[k].dtype, jax.numpy.floating)
        order = [k for k in traced if is_param(k)] + [k for k in traced if not is_param(k)]
        out_tree = None

        def flat_fun(*values):
            nonlocal out_tree
            full = list(leaves)
            for k, v in zip(order, values):
                full[k] = v
            out_leaves, out_tree = tu.tree_flatten(fun(*tu.tree_unflatten(tree, full)))
            return tuple(out_leaves)

        ins = [leaves[k] for k in order]
        jaxpr, consts = _closure_converted(flat_fun, ins)
        # A result that is an argument as it came (an NNX model's state, returned in place)
        # or a literal is not the mark's: it is passed around it.
        inner, values = jaxpr.jaxpr, [*ins, *consts]
        arg = {v: i for i, v in enumerate(inner.invars)}
        around = lambda v: isinstance(v, jcore.Literal) or v in arg     # noqa: E731
        made = [v for v in inner.outvars if not around(v)]
        if len(made) < len(inner.outvars):
            jaxpr = jcore.ClosedJaxpr(inner.replace(
                outvars=made, debug_info=inner.debug_info._replace(result_paths=None)), ())
        marked = iter(value_and_grad_p.bind(*values, jaxpr=jaxpr, num_diff=0, has_aux=True,
                                            num_params=sum(map(is_param, traced)))
                      if made else ())
        outs = [next(marked) if not around(v) else v.val if isinstance(v, jcore.Literal)
                else values[arg[v]] for v in inner.outvars]
        return tu.tree_unflatten(out_tree, outs)

    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """Like `jax.grad(fun, argnums, has_aux)`, and marks the gradient for autopar.

    Example:
        >>> grads = autopar.grad(loss_fn)(params, batch)
    """
    vg = value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fun)
    def wrapped(*args):
        value, grads = vg(*args)
        return (grads, value[1]) if has_aux else grads

    return wrapped
