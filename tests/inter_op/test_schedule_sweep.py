"""The whole schedule matrix of issue 27 (slow): every schedule x {GPT 4 layers, BERT MLM 4
layers, an MLP of 3 layers split unevenly} x {2, 4 stages} x {M = S, 2S, 4S}, 3 Adam steps
on 8 simulated CPU devices with uniform stages: the losses and step 0's gradients equal
`jax.jit` on one device (`test_pipeline_schedules.py` has a fast sample and the trained
state). About 6 s a case on 2 cores."""
import functools
import itertools

import jax
import optax
import pytest

import autopar
from support.equivalence import assert_grads_close, assert_losses_close
from support.steps import bert_mlm_case, make_case, mesh_of, run_steps

S = autopar.Schedule
SCHEDULES = (S.GPIPE, S.ONE_F_ONE_B, S.ZERO_BUBBLE_H1, S.ZERO_BUBBLE_H2, S.INTERLEAVED_1F1B,
             S.ZERO_BUBBLE_V)
LAYERS = {"gpt": 4, "bert": 4, "mlp3": 3}


@functools.cache
def _reference(model):
    if model == "bert":
        step, state, batches = bert_mlm_case()
    else:
        step, state, batches = make_case(
            "mlp" if model == "mlp3" else model, "linen", optax.adam(1e-2),
            num_layers=LAYERS[model], batch_size=16, value_and_grad=autopar.value_and_grad)
    return step, state, batches, run_steps(jax.jit(step), state, batches)


CASES = [(model, schedule, stages, stages * k)
         for model, schedule, stages, k in itertools.product(LAYERS, SCHEDULES, (2, 4), (1, 2, 4))
         if stages <= LAYERS[model]]


@pytest.mark.slow
@pytest.mark.parametrize("model,schedule,stages,microbatches", CASES,
                         ids=[f"{m}-{s.value}-S{n}-M{k}" for m, s, n, k in CASES])
def test_every_schedule_equals_jit(model, schedule, stages, microbatches):
    step, state, batches, ref = _reference(model)
    method = autopar.PipeshardParallel(
        num_microbatches=microbatches, schedule=schedule,
        layer_option=autopar.AutoLayerOption(num_layers=LAYERS[model]),
        stage_option=autopar.UniformStageOption(num_stages=stages))
    got = run_steps(autopar.parallelize(step, mesh=mesh_of((2, 4)), method=method),
                    state, batches)
    assert_losses_close(ref[1], got[1], rtol=2e-5, smooth=model != "mlp3")
    assert_grads_close(ref[2][0], got[2][0], step=0, rtol=2e-5)
