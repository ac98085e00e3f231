"""Layer 7, a plan checked against XLA: compiles a plan (single mesh or pipeline stages) and
compares what XLA compiled with what the plan predicted (memory), re-planning at a scaled budget
where it does not fit. Imports every layer below it."""
