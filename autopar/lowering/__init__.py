"""Lowering: a plan and its graph -> JAX programs with shardings."""
