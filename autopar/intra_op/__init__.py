"""Intra-operator parallelism: sharding strategies per operator chosen by an ILP (Alpa §4)."""
from .ilp import SolverBackend, SolveStatus
from .solve import IlpStats, ShardingAssignment, solve_intra_op

__all__ = ["SolverBackend", "SolveStatus", "IlpStats", "ShardingAssignment", "solve_intra_op"]
