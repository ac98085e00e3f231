"""Layer 1, values only: errors, options and the enums a user passes, the operator graph
(`OpGraph`), sharding specs, the plan dataclasses and their JSON form (`ParallelPlan`, stage
solutions, checked by `plan_check`), number formatting, progress lines and the JAX/PuLP
compatibility shims. Imports no other autopar package."""
