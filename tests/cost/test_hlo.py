"""Reading collectives out of compiled HLO text (`autopar.hlo`)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autopar.cost.hlo import collectives, loop_body_collectives, summary
from support.steps import mesh_of

TEXT = """
  %all-reduce.13 = (f32[256]{0}, f32[256,256]{1,0}, /*index=2*/f32[]) all-reduce(%a, %b, %c), \
channel_id=1, to_apply=%add, \
metadata={op_name="jit(run)/transpose(jvp(MLP))/Dense_0/dot_general"}
  %all-gather.1 = f32[256,256]{0,1} all-gather(%x), channel_id=15, dimensions={1}
  %ag-start = (bf16[8,4]{1,0}, bf16[32,4]{1,0}) all-gather-start(%y), dimensions={0}
  %ag-done = bf16[32,4]{1,0} all-gather-done(%ag-start)
  %a2a = (f32[2,8]{1,0}, f32[2,8]{1,0}) all-to-all(%p, %q), dimensions={0}
  %cp = s32[16]{0} collective-permute(%z), source_target_pairs={{0,1},{1,0}}
  %dot = f32[8,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}
"""


def test_kinds_sizes_and_combined_operands():
    found = collectives(TEXT)
    assert [c.kind for c in found] == ["all-reduce", "all-gather", "all-gather", "all-to-all",
                                       "collective-permute"]
    ar = found[0]
    assert ar.nbytes == 256 * 4 + 256 * 256 * 4 + 4 and ar.num_operands == 3
    assert ar.op_name.endswith("Dense_0/dot_general")
    assert found[1].nbytes == 256 * 256 * 4
    assert found[2].nbytes == 32 * 4 * 2           # the async start's result half, bf16
    assert found[3].nbytes == 2 * 2 * 8 * 4 and found[4].nbytes == 64
    assert summary(found)["all-gather"] == (2, 256 * 256 * 4 + 256)


def test_a_compiled_data_parallel_matmul():
    mesh = mesh_of((1, 4))
    x = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("model")))
    w = jax.device_put(np.ones((16, 4), np.float32), NamedSharding(mesh, P()))
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(x @ w), argnums=0),
                   out_shardings=NamedSharding(mesh, P()))
    found = collectives(grad.lower(w, x).compile().as_text())
    assert summary(found) == {"all-reduce": (1, 16 * 4 * 4)}


def test_a_tuple_all_to_all_is_one_exchange():
    """XLA:CPU prints an all-to-all over n devices as a tuple of n chunks (not an async pair,
    not n combined collectives): all its chunks are the result, and it is one collective."""
    text = ("  %all-to-all.1 = (f32[1,2,2]{2,1,0}, f32[1,2,2]{2,1,0}, f32[1,2,2]{2,1,0}, "
            "f32[1,2,2]{2,1,0}) all-to-all(%p, %q, %r, %s), channel_id=1, "
            "replica_groups=mesh['axis_0'=4] {'axis_0'}, metadata={op_name=\"jit(f)/mul\"}\n")
    (found,) = collectives(text)
    assert (found.kind, found.nbytes, found.num_operands) == ("all-to-all", 4 * 4 * 4, 1)
    assert found.op_name == "jit(f)/mul"


LOOPS = """
%region_body.8 (arg: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %ar.1 = f32[4,8]{1,0} all-reduce(%d), channel_id=2, to_apply=%add
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %ar.1)
}

%region_cond.9 (arg: (s32[], f32[4,8])) -> pred[] {
  %ag.9 = f32[8]{0} all-gather(%v), channel_id=9, dimensions={0}
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

ENTRY %main.1 (p0: f32[4,8]) -> f32[4,8] {
  %ag.2 = f32[16,8]{1,0} all-gather(%p0), channel_id=3, dimensions={0}
  %w = (s32[], f32[4,8]{1,0}) while(%init), condition=%region_cond.9, body=%region_body.8
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%w), index=1
}
"""


def test_loop_body_collectives_are_the_ones_inside_while_bodies():
    assert summary(collectives(LOOPS)) == {"all-reduce": (1, 128), "all-gather": (2, 544)}
    assert summary(loop_body_collectives(LOOPS)) == {"all-reduce": (1, 128)}
    assert loop_body_collectives(TEXT) == []
