"""A3C: asynchronous advantage actor-critic on RLlib's new API stack.

RLlib 2.60 ships no A3C (A2C/A3C were removed; IMPALA and APPO refuse
`vtrace=False`), so this is one, built from the same pieces as PPO here: the
`CausalLMActorCritic` module, the learner connector that adds the KL penalty
and GAE advantages, and whole-sequence batching.

How it runs. Every EnvRunner always has one `sample()` request in flight and
samples with whatever weights it last received. Each time one returns, the
learner takes one gradient step on that batch alone (no epochs, no
minibatches, no importance ratio, no clipping) and sends the new weights back
to that EnvRunner only, without waiting; the others keep sampling. No
iteration waits for all EnvRunners: a slow one delays only its own next batch.
A training iteration ends once `training.train_batch_size` env steps were
sampled in it (`min_sample_timesteps_per_iteration`). With no remote
EnvRunners (`num_env_runners: 0`) the trial's own process samples and learns
in turn, which is synchronous advantage actor-critic (A2C).

How it differs from the 2016 A3C (Mnih et al.). There, Hogwild! workers each
compute gradients on their own copy and apply them lock-free to shared
parameters in one machine's memory. Here the EnvRunners only act; gradients
are computed on the learner(s). Ray processes share no memory, so shipping
gradients from workers would cost as much as shipping the samples while a
transformer's backward pass belongs on the learner's GPU, not on the
inference-only EnvRunners (which keep no value head or reference model).
Staleness is the same in kind: a batch may come from weights a few updates
old, and A3C's loss ignores it, as the original does.

The loss, per token, masked to real steps and averaged:
    -log pi(a|s) * A  +  vf_loss_coeff * (V(s) - R)^2  -  entropy_coeff * H(pi(.|s))
with A and R from GAE over the KL-penalised rewards (lambda = 1 gives the
Monte-Carlo return R_t = sum of rewards to the episode's end, the A3C n-step
return with n covering the whole generation); RLlib's GAE connector
standardises A over the batch.
"""
from __future__ import annotations

from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, LEARNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME

from agents.algorithms.base import pick
from agents.algorithms.ppo import PPOSpec
from agents.algorithms.token_learner import TOKEN_TRAINING, TokenAlgorithm, TokenLearner, TokenLearnerConfig
from agents.algorithms.token_learner import policy_shift_metrics

SAMPLE_TAG = "a3c_sample"
POLL_S = 0.05  # how long one training_step waits for some EnvRunner to return
# algorithm state key: the batches the remote EnvRunners were sampling when the state was taken
IN_FLIGHT = "a3c_in_flight_batches"


def _sample(env_runner):
    """One batch from an EnvRunner, with its metrics (runs on the EnvRunner)."""
    return env_runner.sample(num_episodes=env_runner.config.num_envs_per_env_runner), env_runner.get_metrics()


class A3CTorchLearner(TokenLearner):
    def loss_terms(self, module_id, config, batch, fwd_out, reduce, entropy_coeff):
        """(A3C's loss, its metrics) with means and the explained variance taken by `reduce`
        (`StepMean` over the loss steps; the static update's weighted sums over padded rows)."""
        module = self.module[module_id].unwrapped()
        mean = reduce.mean
        dist = module.get_train_action_dist_cls().from_logits(fwd_out[Columns.ACTION_DIST_INPUTS])
        logp = dist.logp(batch[Columns.ACTIONS])
        entropy = dist.entropy()
        values = module.compute_values(batch, embeddings=fwd_out.get(Columns.EMBEDDINGS))
        targets = batch[Postprocessing.VALUE_TARGETS]
        vf_loss = (values - targets).pow(2)
        policy_loss = -logp * batch[Postprocessing.ADVANTAGES]
        total = mean(policy_loss + config.vf_loss_coeff * vf_loss - entropy_coeff * entropy)
        metrics = {
            "policy_loss": mean(policy_loss),
            "vf_loss": mean(vf_loss),
            "vf_explained_var": reduce.explained_variance(targets, values),
            "entropy": mean(entropy),
            **policy_shift_metrics(batch, logp, fwd_out, mean),  # how stale the batch was
        }
        return total, metrics


class A3CConfig(TokenLearnerConfig):
    """The token learners' config with A3C's algorithm and learner; one gradient step per arriving batch."""

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or A3C)
        self.num_epochs = 1
        self.minibatch_size = None
        self.max_requests_in_flight_per_env_runner = 1

    def get_default_learner_class(self):
        return A3CTorchLearner

    def validate(self):
        # Each arriving batch is one gradient step; an iteration is train_batch_size env steps.
        self.min_sample_timesteps_per_iteration = self.train_batch_size
        self.num_epochs, self.minibatch_size = 1, None
        super().validate()


class A3C(TokenAlgorithm):
    @classmethod
    def get_default_config(cls):
        return A3CConfig()

    def setup(self, config):
        super().setup(config)
        self.updates_by_env_runner = {}  # EnvRunner id (None: local) -> gradient steps on its batches
        self._fetched = []  # batches a get_state fetched, learned at the next training_step

    def get_state(self, components=None, *, not_components=None, **kwargs):
        """RLlib's state (and the remote EnvRunners' rollout states, taken after the sample each
        has in flight), and the batches of those samples: a restored run learns from them first,
        as this one does, where they were lost (the runners' states come after them)."""
        from agents.core import state_requested

        state = super().get_state(components, not_components=not_components, **kwargs)
        group = getattr(self, "env_runner_group", None)
        if group is not None and group.num_remote_workers() and state_requested(IN_FLIGHT, components,
                                                                                not_components):
            self._fetched += group.fetch_ready_async_reqs(tags=SAMPLE_TAG, timeout_seconds=None)
            state[IN_FLIGHT] = list(self._fetched)
        return state

    def set_state(self, state) -> None:
        super().set_state(state)
        self._fetched = list(state.get(IN_FLIGHT, ()))  # (a runner gone since: its batch is learned all the same)

    def training_step(self) -> None:
        group = self.env_runner_group
        fetched, self._fetched = self._fetched, []
        if group.num_remote_workers() == 0:  # A2C: sample here, then learn
            self._learn([*fetched, (None, _sample(self.env_runner))])
            self.env_runner_group.sync_weights(from_worker_or_learner_group=self.learner_group, inference_only=True)
            return
        # Collect the EnvRunners that finished (a short wait, not "until all are back": that would
        # be a barrier), learn on each batch and send that EnvRunner the new weights, then re-arm
        # every idle EnvRunner. Re-arming after the weight sync makes each EnvRunner's next batch
        # come from the weights its last batch produced (an actor runs its calls in order).
        self._learn(fetched + list(group.fetch_ready_async_reqs(tags=SAMPLE_TAG, timeout_seconds=POLL_S)))
        group.foreach_env_runner_async(_sample, tag=SAMPLE_TAG)

    def _learn(self, ready) -> None:
        for runner_id, (episodes, runner_metrics) in ready:
            self.metrics.aggregate([runner_metrics], key=ENV_RUNNER_RESULTS)
            if not episodes:
                continue
            results = self.learner_group.update(
                episodes=episodes,
                timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: self.metrics.peek(
                    (ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0)},
                num_epochs=1,
                minibatch_size=None,
            )
            self.metrics.aggregate(results, key=LEARNER_RESULTS)
            self.metrics.log_value("num_async_updates", 1, reduce="sum")  # per iteration (a "sum" clears on reduce)
            self.updates_by_env_runner[runner_id] = self.updates_by_env_runner.get(runner_id, 0) + 1
            # new weights to the EnvRunner that sent this batch, no waiting (a restored batch's may be gone)
            if runner_id is not None and runner_id in self.env_runner_group.healthy_worker_ids():
                self.env_runner_group.sync_weights(
                    from_worker_or_learner_group=self.learner_group, to_worker_indices=[runner_id],
                    inference_only=True, timeout_seconds=0)



class A3CSpec(PPOSpec):
    names = ("a3c",)
    summary = "A3C (asynchronous actor-critic; A2C with num_env_runners 0): one gradient step per batch"
    # One step per arriving batch: no minibatches, epochs, ratio clipping or value clipping.
    training_params = pick(TOKEN_TRAINING, "lambda", "vf_loss_coeff", "entropy_coeff", "advantage_std_floor",
                           "mle_coef", "mle_batch_size", "static_update", "update_clipping")

    def config_class(self):
        return A3CConfig


SPEC = A3CSpec()
