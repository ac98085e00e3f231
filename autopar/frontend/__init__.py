"""Frontend passes: what a user's step and arguments become before and while tracing (NNX
graph objects as pure state pytrees, `jax.jit`-style argument options, loop regions), and the
user's mesh kept around the run (explicit axes)."""
