"""Primitive categories, shared by the passes that count, shard and report operators.
Pure Python: names only."""
from __future__ import annotations

# Elementwise arithmetic: one FLOP per output element.
ARITHMETIC = frozenset({
    "add", "sub", "mul", "div", "max", "min", "neg", "exp", "exp2", "log", "log1p", "expm1",
    "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "pow", "integer_pow", "square", "abs", "sign",
    "erf", "erfc", "erf_inv", "sin", "cos", "tan", "atan2", "select_n", "clamp", "add_any",
    "rem", "floor", "ceil", "round", "is_finite", "eq", "ne", "lt", "le", "gt", "ge",
    # Newer than jax 0.10 (seen in 0.12): tanh's derivative 1 - t**2, log2, and Horner's rule
    # (jnp.polyval; x and coefficients broadcast as add's operands do).
    "one_minus_square", "log2", "polynomial",
})
# Every primitive that maps equal-shaped operands element by element (sharding follows).
ELEMENTWISE = ARITHMETIC | frozenset({
    "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "and", "or", "not",
    "xor", "convert_element_type", "copy", "copy_p", "reduce_precision", "nextafter", "imag",
    "real", "conj", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "sharding_constraint", "optimization_barrier", "stop_gradient",
    "lgamma", "digamma", "igamma", "logaddexp", "reshard", "device_put", "mesh_cast",
    "threefry2x32", "name",      # `name`: jax.ad_checkpoint.checkpoint_name, an identity
})
# Reductions over `axes`: a split reduced dimension leaves partial results (an all-reduce).
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                        "reduce_and", "reduce_or", "reduce_xor"})
# Ops along one axis that cannot work on a split axis (it is gathered first).
AXIS_OPS = frozenset({"argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
                      "cumlogsumexp", "sort", "top_k"})
# Reductions and scans that cost one FLOP per input element.
REDUCTION_FLOPS = (REDUCTIONS | AXIS_OPS) - {"reduce_xor", "sort", "top_k"}

# Sliding-window reductions (pooling): a dimension under a real window is gathered.
WINDOW_REDUCTIONS = frozenset({"reduce_window_max", "reduce_window_min", "reduce_window_sum",
                               "reduce_window"})
# Gradients of max/min pooling: operand, source and result share the non-window dimensions.
WINDOW_SELECTS = frozenset({"select_and_scatter_add", "select_and_gather_add",
                            "select_and_scatter"})
# PRNG key operations: keys are tiny and follow their operand on the leading (key) dims.
KEY_OPS = frozenset({"random_seed", "random_wrap", "random_unwrap", "random_fold_in",
                     "random_split", "random_clone"})
# Random-bit generators: the bits take any layout (partitionable threefry), the key replicated.
RANDOM_BITS = frozenset({"random_bits"})

MATMUL_LIKE = frozenset({"dot_general", "conv_general_dilated"})   # compute-heavy
# Listed in the dump with their strategies.
HEAVY_OPERATORS = (MATMUL_LIKE | {"gather", "scatter-add", "scatter"} | WINDOW_REDUCTIONS
                   | WINDOW_SELECTS | RANDOM_BITS)
CONTROL_FLOW = frozenset({"scan", "while", "cond"})
# Pseudo-nodes joining a loop body to the outside (frontend/loops.py): carry-in, xs slice,
# ys stack, final carry, a cond's result.
LOOP_CARRY, LOOP_SLICE, LOOP_STACK = "loop_carry", "loop_slice", "loop_stack"
LOOP_EXIT, BRANCH_EXIT = "loop_exit", "branch_exit"
LOOP_PSEUDO = frozenset({LOOP_CARRY, LOOP_SLICE, LOOP_STACK, LOOP_EXIT, BRANCH_EXIT})
# Results that are not constants even when every operand is.
NOT_FOLDABLE = CONTROL_FLOW | LOOP_PSEUDO | {"random_bits", "random_seed", "random_wrap",
                                             "threefry2x32", "rng_bit_generator", "rng_uniform"}
