"""Tests for autopar.hlo: collectives read from compiled HLO text (lines as XLA prints them)."""
from autopar.hlo import Collective, collectives, summary

TEXT = """
  %all-reduce.56 = (f32[64]{0}, f32[64,64]{1,0}, f32[]) all-reduce(%a, %b, %c), channel_id=8, to_apply=%add, metadata={op_name="jit(run)/(x/reduce_sum:y/dot_general:z/reduce_sum)"}
  %all-to-all.1 = (f32[1,2,2]{2,1,0}, f32[1,2,2]{2,1,0}, f32[1,2,2]{2,1,0}, f32[1,2,2]{2,1,0}) all-to-all(%p, %q, %r, %s), channel_id=1, replica_groups=mesh['axis_0'=4] {'axis_0'}, metadata={op_name="jit(f)/mul"}
  %all-to-all.2 = f32[8,8]{1,0} all-to-all(%t), channel_id=2, dimensions={1}
  %all-gather-start = (f32[2,16]{1,0}, f32[4,16]{1,0}) all-gather-start(%u), channel_id=3, dimensions={0}
  %all-gather-done = f32[4,16]{1,0} all-gather-done(%all-gather-start)
  %collective-permute = f32[4,16,1,16]{3,2,1,0} collective-permute(%v), channel_id=11, source_target_pairs={{0,0},{2,1}}
  %get-tuple-element = f32[1,2,2]{2,1,0} get-tuple-element(%all-to-all.1), index=0
"""


def test_collectives_count_combined_operands_and_one_exchange_per_all_to_all():
    got = collectives(TEXT)
    assert [(c.kind, c.nbytes, c.num_operands) for c in got] == [
        ("all-reduce", 4 * (64 + 64 * 64 + 1), 3),    # XLA combined three all-reduces
        ("all-to-all", 4 * 4 * 4, 1),                  # tuple form: one chunk per peer
        ("all-to-all", 8 * 8 * 4, 1),
        ("all-gather", 4 * 16 * 4, 1),                 # async: the result half of the start
        ("collective-permute", 4 * 16 * 16 * 4, 1),
    ]
    assert got[0].op_name.startswith("jit(run)/(x/reduce_sum")


def test_summary_by_kind():
    found = [Collective(kind="all-gather", nbytes=8, op_name="", num_operands=1)] * 2
    assert summary(found) == {"all-gather": (2, 16)}
