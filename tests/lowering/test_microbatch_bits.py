"""`lowering.microbatch_bits`: microbatch m's rows of the whole batch's random draw, computed
from their indices alone, equal the rows of `jax.random.bits` / `jax.random.split` drawn
whole (microbatch m holds examples m, m + M, ...)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar.inter_op.random_rows import RandomRows
from autopar.lowering.microbatch_bits import _Rows

M = 4
KEY = jax.random.fold_in(jax.random.key(5), 9)


def _rows_of(full, dim, per_example, m):
    """Microbatch m's rows of a whole-batch array (examples m, m + M, ... along `dim`)."""
    x = np.moveaxis(np.asarray(full), dim, 0)
    rows, rest = x.shape[0] // (M * per_example), x.shape[1:]
    x = x.reshape(rows, M, per_example, *rest)[:, m]
    return np.moveaxis(x.reshape(rows * per_example, *rest), 0, dim)


@pytest.mark.parametrize("shape, dim, per_example, width", [
    ((2, 3, 5), 0, 1, 32), ((3, 2, 5), 1, 1, 8), ((6, 5), 0, 3, 16), ((2, 4, 4, 3), 0, 1, 32)])
def test_bits_are_the_rows_of_the_whole_draw(shape, dim, per_example, width):
    full = list(shape)
    full[dim] *= M
    dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[width]
    whole = jax.random.bits(KEY, tuple(full), dtype=dtype)
    draw = RandomRows(primitive="random_bits", shape=shape, dim=dim, per_example=per_example)
    fn = jax.jit(lambda key, mb: _Rows(draw, M, mb).bind(key, bit_width=width, shape=shape))
    for m in range(M):
        got = fn(KEY, jnp.int32(m))
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, _rows_of(whole, dim, per_example, m))


def test_split_keys_are_the_rows_of_the_whole_split():
    whole = jax.random.key_data(jax.random.split(KEY, 8 * M))
    draw = RandomRows(primitive="random_split", shape=(8,), dim=0, per_example=1)
    for m in range(M):
        got = _Rows(draw, M, jnp.int32(m)).bind(KEY, shape=(8,))
        assert jax.random.key_impl(got) == jax.random.key_impl(KEY)
        np.testing.assert_array_equal(jax.random.key_data(got), whole[m::M])
