"""Inter-operator parallelism: layers -> pipeline stages on submeshes, chosen by a DP (Alpa §5)."""
from .stage_dp import (StageAssignment, StageCosts, SubmeshShape, brute_force_stages,
                       candidate_submeshes, solve_stage_dp)

__all__ = ["SubmeshShape", "candidate_submeshes", "StageCosts", "StageAssignment",
           "solve_stage_dp", "brute_force_stages"]
