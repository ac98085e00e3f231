"""Frontend passes: what a user's step and arguments become before tracing (NNX graph objects
as pure state pytrees, `jax.jit`-style argument options) and the user's mesh kept around the
run (explicit axes)."""
