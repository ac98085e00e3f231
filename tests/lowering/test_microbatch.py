"""`lowering.microbatch`: microbatch values merged back into the full batch's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.lowering.microbatch import interleave


def _split(x, m):
    """The executor's microbatches: microbatch i holds examples i, i + m, i + 2m, ..."""
    return [x.reshape(x.shape[0] // m, m, *x.shape[1:])[:, i] for i in range(m)]


@pytest.mark.parametrize("m", [1, 2, 4])
def test_interleave_undoes_the_split(m):
    x = jnp.arange(8 * 3 * 5).reshape(8, 3, 5)
    parts = _split(x, m)
    np.testing.assert_array_equal(interleave(parts, dim=0, rows=8 // m), x)
    # the batch on another dimension, and flattened with 3 entries per example
    moved = [jnp.moveaxis(p, 0, 1) for p in parts]
    np.testing.assert_array_equal(interleave(moved, dim=1, rows=8 // m), jnp.moveaxis(x, 0, 1))
    flat = [p.reshape(-1, 5) for p in parts]
    np.testing.assert_array_equal(interleave(flat, dim=0, rows=8 // m), x.reshape(-1, 5))


def test_interleave_is_not_concatenation():
    parts = _split(jnp.arange(8.0), 4)
    assert not np.array_equal(interleave(parts, dim=0, rows=2), jnp.concatenate(parts))
    assert jax.jit(lambda *p: interleave(p, dim=0, rows=2))(*parts).tolist() == list(range(8))
