"""Options of PipeshardParallel: defaults, validation errors of the method and of the layer and
stage options, normalization of ManualStageOption, immutability."""
import dataclasses

import pytest

import autopar
from autopar.core.options import LayerOptionKind, MethodKind

Auto, Uniform, Manual = autopar.AutoStageOption, autopar.UniformStageOption, \
    autopar.ManualStageOption


def manual(spans=((0, 1), (2, 3)), subs=((1, 4), (1, 4)), logical=((2, 2), (1, 4))):
    return Manual(layer_spans=spans, submesh_shapes=subs, logical_shapes=logical)


# -- PipeshardParallel ----------------------------------------------------------------------

def test_pipeshard_defaults():
    m = autopar.PipeshardParallel()
    assert m.kind is MethodKind.PIPESHARD
    assert (m.num_microbatches, m.max_in_flight_calls) == (1, 16)
    assert m.schedule is autopar.Schedule.ONE_F_ONE_B
    assert m.layer_option == autopar.AutoLayerOption()
    assert m.stage_option == autopar.AutoStageOption()
    assert m.memory_budget_bytes is None
    assert isinstance(m, autopar.ShardParallel)      # carries the intra-op solver settings


def test_pipeshard_accepts_every_option_kind():
    for layer in (autopar.AutoLayerOption(num_layers=2), autopar.ManualLayerOption()):
        for stage in (Auto(max_stages=2), Uniform(num_stages=2), manual()):
            m = autopar.PipeshardParallel(num_microbatches=8, schedule=autopar.Schedule.GPIPE,
                                          layer_option=layer, stage_option=stage,
                                          max_in_flight_calls=1, memory_budget_bytes=2 ** 20)
            assert m.layer_option is layer and m.stage_option is stage


@pytest.mark.parametrize("field", ["num_microbatches", "max_in_flight_calls"])
@pytest.mark.parametrize("value", [0, -2, True, 2.0, "4", None])
def test_pipeshard_counts_must_be_positive_ints(field, value):
    with pytest.raises(autopar.InvalidArgumentError, match=f"PipeshardParallel.{field}="):
        autopar.PipeshardParallel(**{field: value})


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", None, 0])
def test_pipeshard_schedule_must_be_a_schedule(schedule):
    with pytest.raises(autopar.InvalidArgumentError, match="is not a Schedule"):
        autopar.PipeshardParallel(schedule=schedule)


@pytest.mark.parametrize("option", [Uniform(num_stages=2), None, 4, "auto"])
def test_pipeshard_layer_option_type(option):
    with pytest.raises(autopar.InvalidArgumentError, match="layer_option=.*AutoLayerOption"):
        autopar.PipeshardParallel(layer_option=option)


@pytest.mark.parametrize("option", [autopar.AutoLayerOption(), None, 2, "uniform"])
def test_pipeshard_stage_option_type(option):
    with pytest.raises(autopar.InvalidArgumentError, match="stage_option=.*UniformStageOption"):
        autopar.PipeshardParallel(stage_option=option)


def test_pipeshard_keeps_shard_parallel_validation():
    with pytest.raises(autopar.InvalidArgumentError, match="memory_budget_bytes"):
        autopar.PipeshardParallel(memory_budget_bytes=0)
    with pytest.raises(autopar.InvalidArgumentError, match="solver_time_limit_s"):
        autopar.PipeshardParallel(solver_time_limit_s=0)


def test_options_are_frozen_keyword_only_values():
    m = autopar.PipeshardParallel(num_microbatches=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.num_microbatches = 4
    with pytest.raises(TypeError):
        autopar.UniformStageOption(2)
    with pytest.raises(TypeError):
        autopar.AutoLayerOption(4)
    assert dataclasses.replace(m, num_microbatches=4).num_microbatches == 4
    with pytest.raises(autopar.InvalidArgumentError):     # replace validates again
        dataclasses.replace(m, num_microbatches=0)
    assert autopar.PipeshardParallel(num_microbatches=2) == m
    assert hash(Uniform(num_stages=2)) == hash(Uniform(num_stages=2))


# -- layer options --------------------------------------------------------------------------

def test_layer_option_kinds():
    assert autopar.AutoLayerOption().kind is LayerOptionKind.AUTO
    assert autopar.ManualLayerOption().kind is LayerOptionKind.MANUAL
    auto = autopar.AutoLayerOption()
    assert (auto.num_layers, auto.imbalance) == (4, 0.25)


@pytest.mark.parametrize("num_layers", [0, -1, True, 2.0, "4", None])
def test_auto_layer_count(num_layers):
    with pytest.raises(autopar.InvalidArgumentError, match="AutoLayerOption.num_layers"):
        autopar.AutoLayerOption(num_layers=num_layers)


@pytest.mark.parametrize("imbalance", [-0.01, float("nan")])
def test_auto_layer_imbalance(imbalance):
    with pytest.raises(autopar.InvalidArgumentError, match="AutoLayerOption.imbalance"):
        autopar.AutoLayerOption(imbalance=imbalance)
    assert autopar.AutoLayerOption(imbalance=0.0).imbalance == 0.0


# -- stage options --------------------------------------------------------------------------

@pytest.mark.parametrize("max_stages", [0, -3, 1.5, "2"])
def test_auto_stage_max_stages(max_stages):
    with pytest.raises(autopar.InvalidArgumentError, match="AutoStageOption.max_stages"):
        Auto(max_stages=max_stages)


@pytest.mark.parametrize("shapes", ["grid", "ALL", None, ("all",)])
def test_auto_stage_logical_shapes(shapes):
    with pytest.raises(autopar.InvalidArgumentError, match="'all' or 'flat'"):
        Auto(logical_shapes=shapes)


def test_auto_stage_valid_values():
    assert Auto(max_stages=1, logical_shapes="flat").max_stages == 1
    assert Auto().max_stages is None and Auto().logical_shapes == "all"


@pytest.mark.parametrize("num_stages", [0, -1, True, 2.0, None])
def test_uniform_stage_count(num_stages):
    with pytest.raises(autopar.InvalidArgumentError, match="UniformStageOption.num_stages"):
        Uniform(num_stages=num_stages)


def test_manual_stage_normalizes_to_int_tuples():
    opt = manual(spans=[[0, 0], (1, 3)], subs=[[1, 2], [1, 6]], logical=[(2, 1), [3, 2]])
    assert opt.layer_spans == ((0, 0), (1, 3))
    assert opt.submesh_shapes == ((1, 2), (1, 6))
    assert opt.logical_shapes == ((2, 1), (3, 2))
    assert opt == manual(spans=((0, 0), (1, 3)), subs=((1, 2), (1, 6)),
                         logical=((2, 1), (3, 2)))


@pytest.mark.parametrize("spans", [
    ((1, 1), (2, 3)),       # does not start at layer 0
    ((0, 1), (3, 3)),       # a gap
    ((0, 2), (2, 3)),       # overlap
    ((0, 1), (3, 2)),       # last < first
    ((0, -1), (0, 3)),      # negative
])
def test_manual_stage_spans_must_tile_the_layers(spans):
    with pytest.raises(autopar.InvalidArgumentError, match="layer_spans"):
        manual(spans=spans)


@pytest.mark.parametrize("subs,logical", [
    (((1, 4),), ((2, 2), (1, 4))),               # one submesh for two stages
    (((1, 4), (1, 4)), ((2, 2),)),               # one logical shape for two stages
    (((1, 4), (1, 4), (1, 4)), ((2, 2), (1, 4), (4, 1))),
])
def test_manual_stage_needs_one_shape_per_stage(subs, logical):
    with pytest.raises(autopar.InvalidArgumentError, match="one per stage"):
        manual(subs=subs, logical=logical)


@pytest.mark.parametrize("subs,logical", [
    (((1, 4), (1, 4)), ((2, 2), (2, 4))),        # 4 devices viewed as 8
    (((1, 4), (1, 2)), ((2, 2), (1, 4))),
    (((1, 2, 2), (1, 4)), ((2, 2), (1, 4))),     # a submesh is (hosts, devices per host)
])
def test_manual_stage_submesh_and_logical_device_counts(subs, logical):
    with pytest.raises(autopar.InvalidArgumentError, match="same device count"):
        manual(subs=subs, logical=logical)


@pytest.mark.parametrize("value", [3, None, (0, 1), ((0, None),)])
def test_manual_stage_rejects_non_tuples(value):
    with pytest.raises(autopar.InvalidArgumentError, match="ManualStageOption.layer_spans"):
        manual(spans=value)


def test_manual_stage_rejects_non_numeric_strings():
    with pytest.raises(autopar.InvalidArgumentError, match="ManualStageOption.layer_spans"):
        manual(spans=((0, "a"), (2, 3)))


def test_manual_stage_rejects_zero_stages():
    with pytest.raises(autopar.InvalidArgumentError):
        manual(spans=(), subs=(), logical=())


def test_manual_stage_rejects_non_integral_numbers():
    with pytest.raises(autopar.InvalidArgumentError):
        manual(spans=((0, 1.7), (2, 3)))


def test_auto_stage_max_stages_rejects_bool():
    with pytest.raises(autopar.InvalidArgumentError):
        Auto(max_stages=True)
