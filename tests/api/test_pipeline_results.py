"""A pipeline runs the Flax lm1b example's own train_step (issue 26): metrics computed after
the pipelined loss from its outputs and from gradients on different stages, equal to jax.jit's,
and the results usable together by the example's eager loop (sums, a division by the token
count): what the step computes comes back on the whole mesh, as `jax.jit` returns it, while
the next step's state stays on its stages."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import autopar
from support.steps import lm1b_state_and_batches, mesh_of

LR = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)


def compute_weighted_cross_entropy(logits, targets, weights):
    soft = jax.nn.one_hot(targets, logits.shape[-1])
    loss = -jnp.sum(soft * jax.nn.log_softmax(logits), axis=-1) * weights
    return loss.sum(), weights.sum()


def compute_metrics(logits, labels, weights):
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights)
    acc = (jnp.equal(jnp.argmax(logits, axis=-1), labels) * weights).sum()
    return {"loss": loss, "accuracy": acc, "denominator": weight_sum}


def make_step(value_and_grad):
    def train_step(state, batch, dropout_rng):     # the example's, with grad norms added
        inputs, targets = batch["inputs"], batch["targets"]
        weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
        dropout_rng = jax.random.fold_in(dropout_rng, state.step)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, inputs, rngs={"dropout": dropout_rng})
            loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights)
            return loss / weight_sum, logits
        lr = LR(state.step)
        (_, logits), grads = value_and_grad(loss_fn, has_aux=True)(state.params)
        new_state = state.apply_gradients(grads=grads)
        metrics = compute_metrics(logits, targets, weights)
        metrics["learning_rate"] = lr
        metrics["embed_grad_norm"] = optax.tree.norm(grads["Embed_0"])      # first stage
        metrics["head_grad_norm"] = optax.tree.norm(grads["LayerNorm_0"])   # last stage
        return new_state, metrics
    return train_step


def _summaries(step, state, batches):
    """The example's loop: per step, the metrics summed and divided by the token count,
    eagerly, after the step."""
    out = []
    for batch in batches:
        state, metrics = step(state, batch, jax.random.PRNGKey(1))
        sums = jax.tree.map(jnp.sum, metrics)
        denominator = sums.pop("denominator")
        summary = jax.tree.map(lambda x: x / denominator, sums)
        summary["norm_ratio"] = metrics["embed_grad_norm"] / metrics["head_grad_norm"]
        out.append({k: float(v) for k, v in summary.items()})
    return out, state


def test_the_lm1b_train_step_runs_as_a_two_stage_pipeline_with_its_eager_loop():
    state, batches = lm1b_state_and_batches(optax.adamw(LR))
    want, _ = _summaries(jax.jit(make_step(jax.value_and_grad)), state, batches)
    par = autopar.parallelize(make_step(autopar.value_and_grad), mesh=mesh_of((2, 4)),
                              plan_cache=False, method=autopar.PipeshardParallel(
                                  num_microbatches=4,
                                  layer_option=autopar.AutoLayerOption(num_layers=2),
                                  stage_option=autopar.UniformStageOption(num_stages=2)))
    got, new_state = _summaries(par, state, batches)
    assert len(par.get_plan(state, batches[0], jax.random.PRNGKey(1)).stages) == 2
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for k in w:      # a ReLU model: step 2's values by the routing rule's loss tolerance
            np.testing.assert_allclose(g[k], w[k], rtol=1e-4, atol=1e-7, err_msg=k)
    # the state stays where the next step reads it: on its stage's devices
    devices = {d for x in jax.tree_util.tree_leaves(new_state.params)
               for d in [frozenset(x.sharding.device_set)]}
    assert len(devices) == 2 and all(len(d) == 4 for d in devices)
