"""Inter-operator parallelism: layers -> pipeline stages on submeshes, chosen by a DP (Alpa §5)."""
from autopar.inter_op.layers import LayerClustering, cluster_layers, cut_bytes_from_liveness
from autopar.inter_op.stage_dp import (
                                       StageAssignment,
                                       StageCosts,
                                       SubmeshShape,
                                       candidate_submeshes,
                                       solve_stage_dp,
)
from autopar.inter_op.stage_dp_brute import brute_force_stages

__all__ = ["LayerClustering", "cluster_layers", "cut_bytes_from_liveness",
           "SubmeshShape", "candidate_submeshes", "StageCosts", "StageAssignment",
           "solve_stage_dp", "brute_force_stages"]
