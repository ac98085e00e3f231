"""Intra-operator parallelism: sharding strategies per operator chosen by an ILP (Alpa §4)."""
from autopar.core.enums import SolverBackend
from autopar.core.plan import IlpStats
from autopar.intra_op.ilp import SolveStatus
from autopar.intra_op.solve import ShardingAssignment, solve_intra_op

__all__ = ["SolverBackend", "SolveStatus", "IlpStats", "ShardingAssignment", "solve_intra_op"]
