"""The ILP after presolve (`ilp._presolve`), which the MIP builder and the heuristics read."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class _Reduced:
    """The problem after presolve. Groups with `choice[g] >= 0` are fixed; `var_groups` keep
    variables. Memory rows are (terms with bytes shifted to min 0, rhs = budget - constant)."""
    choice: np.ndarray
    var_groups: tuple[int, ...]
    node_costs: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...]
    mem_rows: tuple[tuple[tuple[tuple[int, np.ndarray], ...], float], ...]
    infeasible: bool
