"""Layer 3, what things cost: the cluster description (`ClusterSpec`, logical meshes), the cost
model (roofline compute, alpha-beta collectives), HLO collective reading, on-device profiling,
measurement and calibration. Imports `core` and `frontend`."""
