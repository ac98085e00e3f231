"""Inter-operator parallelism: layers -> pipeline stages on submeshes, chosen by a DP (Alpa §5)."""
from autopar.inter_op.layers import LayerClustering, cluster_layers, cut_bytes_from_liveness
from autopar.inter_op.stage_dp import (
                                       StageAssignment,
                                       StageCosts,
                                       SubmeshShape,
                                       brute_force_stages,
                                       candidate_submeshes,
                                       solve_stage_dp,
)

__all__ = ["LayerClustering", "cluster_layers", "cut_bytes_from_liveness",
           "SubmeshShape", "candidate_submeshes", "StageCosts", "StageAssignment",
           "solve_stage_dp", "brute_force_stages"]
