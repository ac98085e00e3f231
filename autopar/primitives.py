"""Primitive categories, shared by the passes that count, shard and report operators.
Pure Python: names only."""
from __future__ import annotations

# Elementwise arithmetic: one FLOP per output element.
ARITHMETIC = frozenset({
    "add", "sub", "mul", "div", "max", "min", "neg", "exp", "exp2", "log", "log1p", "expm1",
    "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "pow", "integer_pow", "square", "abs", "sign",
    "erf", "erfc", "erf_inv", "sin", "cos", "tan", "atan2", "select_n", "clamp", "add_any",
    "rem", "floor", "ceil", "round", "is_finite", "eq", "ne", "lt", "le", "gt", "ge",
})
# Every primitive that maps equal-shaped operands element by element (sharding follows).
ELEMENTWISE = ARITHMETIC | frozenset({
    "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "and", "or", "not",
    "xor", "convert_element_type", "copy", "copy_p", "reduce_precision", "nextafter", "imag",
    "real", "conj", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "sharding_constraint", "optimization_barrier", "stop_gradient",
    "lgamma", "digamma", "igamma", "logaddexp", "reshard", "device_put", "mesh_cast",
})
# Reductions over `axes`: a split reduced dimension leaves partial results (an all-reduce).
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                        "reduce_and", "reduce_or", "reduce_xor"})
# Ops along one axis that cannot work on a split axis (it is gathered first).
AXIS_OPS = frozenset({"argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
                      "cumlogsumexp", "sort", "top_k"})
# Reductions and scans that cost one FLOP per input element.
REDUCTION_FLOPS = (REDUCTIONS | AXIS_OPS) - {"reduce_xor", "sort", "top_k"}

MATMUL_LIKE = frozenset({"dot_general", "conv_general_dilated"})   # compute-heavy
HEAVY_OPERATORS = MATMUL_LIKE | {"gather", "scatter-add", "scatter"}   # listed in the dump
CONTROL_FLOW = frozenset({"scan", "while", "cond"})
# Results that are not constants even when every operand is.
NOT_FOLDABLE = CONTROL_FLOW | {"random_bits", "random_seed", "random_wrap",
                               "rng_bit_generator", "rng_uniform"}
