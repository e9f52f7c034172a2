"""The machinery every token-level learner shares (PPO, A2C/A3C, REINFORCE, the guided family).

Differences from RLlib's stock PPO learner, which each of them inherits:
  * a per-token KL penalty against the frozen initial policy is folded into
    the rewards before GAE (`kl_control.ReferenceKLPenalty`), with a fixed or
    adaptive coefficient;
  * the losses read only the rollout's log-prob of the chosen action, never the
    stored full action-distribution inputs (one float per step instead of V);
  * only trainable parameters go to the optimizer (the reference is frozen);
  * episodes that terminated get no artificial bootstrap step (their bootstrap value
    is 0), so the learner batch holds only real steps (`AddOneTsToUnfinishedEpisodes`);
  * minibatches hold whole sequences and the module forwards each sequence
    once, reading every step's logits and value from that one pass
    (`sequence_batching`);
  * with a truncation sampler the module's training logits are masked like the
    rollout's; with `masking: learned` (NLPO) the learner copies the policy
    into the masking policy after every `sync_every`-th update (one update per
    training iteration), and the count survives checkpoints.
"""
from __future__ import annotations

import numpy as np
import torch
from ray.rllib.algorithms.ppo import PPO, PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.connectors.learner import AddOneTsToEpisodesAndTruncate, GeneralAdvantageEstimation
from ray.rllib.core.columns import Columns
from ray.rllib.utils.torch_utils import explained_variance

from agents.algorithms.advantages import RLLIB_STD_FLOOR, FloorAdvantageStd
from agents.algorithms.base import (REFERENCE_KL, DeclaredParams, Param, RemoteRunnerStates, adam, rllib_fields,
                                   use_configured_lr)
from agents.algorithms.gradients import FusedGradients
from agents.algorithms.kl_control import AdaptiveKLController, ReferenceKLPenalty
from agents.algorithms.mle import ReferencePairs, reference_nll
from agents.algorithms.static_update import StaticUpdate
from agents.algorithms.sequence_batching import (
    AddOneTsToUnfinishedEpisodes,
    AddSequenceIds,
    sequence_minibatches,
    token_learner_pipeline,
)
from agents.core import MASK_SIZE, global_rng_state, set_global_rng_state, state_requested
from agents.weight_sync import install_colocated_sync, settle_sync_dtype
from env.validation import Field

LEARNER_RNG = "rng_state"  # learner state key: the generators of its updates
GRAD_SCALERS = "grad_scalers"  # learner state key (fp16): each module's loss scaler (scale, growth tracker)


def learner_rank() -> int:
    """This learner's rank among several (torch.distributed), 0 for a single learner."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_learners_kl(measured: dict) -> dict:
    """The KL measurement over every learner's shard of the batch, not just this one's.

    With several learners each sees part of the batch; the adaptive KL coefficient must
    follow the whole batch's KL on all of them, or their coefficients (and losses) drift
    apart. Without torch.distributed (one learner) the local measurement is the whole one.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return measured
    n = measured["n_sequences"]
    totals = torch.tensor([measured["ref_kl"] * n, float(n)], dtype=torch.float64)
    dist.all_reduce(totals)
    return {**measured, "ref_kl": float(totals[0] / totals[1]), "n_sequences": int(totals[1])}

def loss_step_mean(batch):
    """x -> the mean of x over the loss steps (Columns.LOSS_MASK; over every step without one)."""
    if Columns.LOSS_MASK not in batch:
        return torch.mean
    mask = batch[Columns.LOSS_MASK]
    num_valid = mask.sum()
    return lambda x: x[mask].sum() / num_valid


class StepMean:
    """How RLlib's update reduces a loss's per-step terms: `mean` over the loss steps
    (`loss_step_mean`), and RLlib's explained variance over the same steps (PPO++'s guide steps,
    masked out of the value loss, are not the value head's to explain). The static update
    reduces with weighted sums instead (`agents/algorithms/static_update.py WeightedMean`)."""

    def __init__(self, batch):
        self.mean = loss_step_mean(batch)
        self.mask = batch.get(Columns.LOSS_MASK)

    def explained_variance(self, y, pred):
        if self.mask is None:
            return explained_variance(y, pred)
        return explained_variance(y[self.mask], pred[self.mask])


def policy_shift_metrics(batch, logp, fwd_out, mean) -> dict:
    """How far this update moved the policy: the sampled-action estimate of KL(old || new), and
    with a truncation sampler the mask size and the share of actions outside the current mask.
    With `current` masking an action can fall outside the updated policy's mask (log-prob
    ~ -3e38, ratio 0): such steps are counted apart instead of making the estimate infinite."""
    log_gap = (batch[Columns.ACTION_LOGP] - logp).detach()
    outside = (log_gap > 1e30).float()
    out = {"mean_kl_loss": mean(torch.where(outside.bool(), 0.0, log_gap))}
    if MASK_SIZE in fwd_out:
        out.update(mask_size=mean(fwd_out[MASK_SIZE]), actions_outside_mask=mean(outside))
    return out


# The token learners' `training` hyperparameters (PPO reads them all; A2C/A3C and REINFORCE
# `pick` theirs): declared here once, for the YAML schema, the spec and the RLlib config.
TOKEN_TRAINING = {
    "minibatch_size": Param(Field(int, 256, lo=1)),
    "num_epochs": Param(Field(int, 4, lo=1)),
    "lambda": Param(Field(float, 0.95, lo=0.0, hi=1.0), "lambda_"),
    "clip_param": Param(Field(float, 0.2, lo=0.0, lo_open=True)),
    "vf_loss_coeff": Param(Field(float, 0.5, lo=0.0)),
    "vf_clip_param": Param(Field(float, 10.0, lo=0.0, lo_open=True)),
    "entropy_coeff": Param(Field(float, 0.0, lo=0.0)),
    # Advantages are standardized per batch as (A - mean) / max(floor, std), the floor in the
    # reward's units; RLlib's is 1e-4; above every std: centred, unscaled (agents/algorithms/advantages.py).
    "advantage_std_floor": Param(Field(float, RLLIB_STD_FLOOR, lo=0.0, lo_open=True)),
    # Mixed objective: + mle_coef * NLL of the task's reference continuations given their
    # prompts (mle_batch_size pairs per loss computation, mle.py); 0: pure RL.
    "mle_coef": Param(Field(float, 0.0, lo=0.0)),
    "mle_batch_size": Param(Field(int, 16, lo=1)),
    # The update as one static function of bucketed shapes; on a GPU captured once per bucket as
    # a CUDA graph and replayed (agents/algorithms/static_update.py); on a CPU run eagerly.
    "static_update": Param(Field(bool, False)),
    # StableAdamW's update clipping: each tensor's Adam step scaled by 1 / max(1, RMS of g / sqrt(v))
    # (agents/algorithms/gradients.py UpdateClipping)
    "update_clipping": Param(Field(bool, False)),
}


class LossScaler(torch.amp.GradScaler):
    """fp16's loss scaler (RLlib's `_torch_grad_scaler_class`) on the learner's device type."""

    def __init__(self):
        super().__init__("cuda" if torch.cuda.is_available() else "cpu")


class TokenLearner(StaticUpdate, FusedGradients, PPOTorchLearner):
    """RLlib's PPO learner with what every token-level loss here shares: the learner pipeline's
    edits (no bootstrap step for finished episodes, sequence ids, the reference-KL penalty before
    GAE), whole-sequence minibatches, the optimizer over trainable parameters, fp16's unscaling
    before clipping, the MLE term, NLPO's mask-model sync, the KL controller's update, and the
    generators of its updates in its state. A subclass writes `loss_terms` (then the static update
    can run its loss too), or `compute_loss_for_module` itself."""

    # RLlib's GAE makes the advantages, and a floor other than RLlib's standardizes them again
    # after it (`FloorAdvantageStd`); False where GAE is replaced (the guided estimate applies the
    # floor itself; REINFORCE's advantages are not standardized)
    floor_after_gae = True

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        entropy_coeff = self.entropy_coeff_schedulers_per_module[module_id].get_current_value()
        total, metrics = self.loss_terms(module_id, config, batch, fwd_out, StepMean(batch), entropy_coeff)
        self.metrics.log_dict(metrics, key=module_id, window=1)
        return self.add_mle_term(module_id, total)

    def build(self) -> None:
        super().build()
        cfg = self.config
        self.kl_penalty = None
        if cfg.ref_kl_coef > 0.0 and self._learner_connector is not None:
            controller = AdaptiveKLController(
                cfg.ref_kl_coef, cfg.ref_kl_target if cfg.ref_kl_adaptive else None, cfg.ref_kl_horizon)
            self.kl_penalty = ReferenceKLPenalty(controller=controller)
            self._learner_connector.insert_before(GeneralAdvantageEstimation, self.kl_penalty)
        if self._learner_connector is not None:
            pipeline = self._learner_connector
            if any(type(c) is AddOneTsToEpisodesAndTruncate for c in pipeline.connectors):
                pipeline.insert_after(AddOneTsToEpisodesAndTruncate, AddOneTsToUnfinishedEpisodes())
                pipeline.remove(AddOneTsToEpisodesAndTruncate)
            self._learner_connector.insert_before(
                ReferenceKLPenalty if self.kl_penalty is not None else GeneralAdvantageEstimation, AddSequenceIds()
            )
            if cfg.advantage_std_floor != RLLIB_STD_FLOOR and self.floor_after_gae:
                pipeline.insert_after(GeneralAdvantageEstimation, FloorAdvantageStd(floor=cfg.advantage_std_floor))
        self._minibatch_rng = np.random.default_rng(self._learner_seed())
        self.mle_pairs = None
        if cfg.mle_coef > 0.0:  # the supervised term of the mixed objective (agents/algorithms/mle.py)
            tokenizer = next(iter(self.module.values())).unwrapped().tokenizer
            self.mle_pairs = ReferencePairs(cfg.env_config, tokenizer, seed=self._learner_seed())
        self.num_updates = 0  # gradient-based updates so far (one per training iteration)

    def _learner_seed(self, *more: int):
        """The config's seed for learner 0 (and no `more`), else the seed, this learner's rank
        and `more`: each learner shuffles its shard and draws MLE pairs on its own stream."""
        seed, rank = int(self.config.seed or 0), learner_rank()
        return seed if rank == 0 and not more else [seed, rank, *more]

    def _create_iterator_if_necessary(self, *, training_data, num_epochs=1, minibatch_size=None,
                                      shuffle_batch_per_epoch=False, num_total_minibatches=0, **kwargs):
        """Minibatches of whole sequences, so each sequence is forwarded once per minibatch."""
        if training_data.data_iterators:
            return super()._create_iterator_if_necessary(
                training_data=training_data, num_epochs=num_epochs, minibatch_size=minibatch_size,
                shuffle_batch_per_epoch=shuffle_batch_per_epoch, num_total_minibatches=num_total_minibatches,
                **kwargs)
        batch = self._make_batch_if_necessary(training_data=training_data)
        for module_id in list(batch.policy_batches):
            if not self.should_module_be_updated(module_id, batch):
                del batch.policy_batches[module_id]
        if not batch.policy_batches:
            return {}
        return sequence_minibatches(batch, num_epochs=num_epochs, minibatch_size=minibatch_size,
                                    shuffle=shuffle_batch_per_epoch, rng=self._minibatch_rng,
                                    num_total_minibatches=num_total_minibatches)

    def postprocess_gradients(self, gradients_dict):
        """With fp16's loss scaler, the gradients are unscaled before they are clipped (RLlib
        would clip the scaled ones); the scaler's step then skips an update with inf/nan."""
        if self._grad_scalers is not None:
            for module_id, names in self._module_optimizers.items():
                for name in names:
                    self._grad_scalers[module_id].unscale_(self.get_optimizer(module_id, name))
        return super().postprocess_gradients(gradients_dict)

    def configure_optimizers_for_module(self, module_id, config=None):
        params = [p for p in self.get_parameters(self.module[module_id]) if p.requires_grad]
        self.register_optimizer(
            module_id=module_id, optimizer=adam(params, self), params=params, lr_or_lr_schedule=config.lr
        )

    def add_mle_term(self, module_id, total):
        """total + mle_coef * NLL of a fresh draw of reference continuations (unchanged at coef 0)."""
        if self.mle_pairs is None:
            return total
        coef = self.config.mle_coef
        lm = self.module[module_id].unwrapped().lm
        nll = reference_nll(lm, *self.mle_pairs.batch(self.config.mle_batch_size, device=next(lm.parameters()).device))
        self.metrics.log_dict({"mle_nll": nll.detach(), "mle_coef": coef}, key=module_id, window=1)
        return total + coef * nll

    def after_gradient_based_update(self, *, timesteps):
        super().after_gradient_based_update(timesteps=timesteps)
        self.num_updates += 1
        for module_id in self.module.keys():
            module = self.module[module_id].unwrapped()
            sampler = getattr(module, "sampler", None)
            if sampler is None or not sampler.active:
                continue
            metrics = {f"sampler_{k}": float(v) for k, v in sampler.params.items()}
            if sampler.learned:
                if self.num_updates % sampler.sync_every == 0:
                    module.sync_mask_model()
                metrics["mask_model_syncs"] = self.num_updates // sampler.sync_every
            self.metrics.log_dict(metrics, key=module_id, window=1)
        if self.kl_penalty is None:
            return
        for module_id, measured in self.kl_penalty.last.items():
            measured = all_learners_kl(measured)
            coef_used = self.kl_penalty.controller.coef
            self.kl_penalty.controller.update(measured["ref_kl"], measured["n_sequences"])
            self.metrics.log_dict(
                {"ref_kl": measured["ref_kl"], "ref_kl_per_token": measured["ref_kl_per_token"],
                 "ref_kl_coef": coef_used},
                key=module_id,
                window=1,
            )

    def get_state(self, components=None, *, not_components=None, **kwargs):
        state = super().get_state(components, not_components=not_components, **kwargs)
        state["num_updates"] = self.num_updates
        if self.kl_penalty is not None:
            state["ref_kl_coef"] = self.kl_penalty.controller.coef
        if state_requested(LEARNER_RNG, components, not_components):
            state[LEARNER_RNG] = self._rng_state()
        if self._grad_scalers and state_requested(GRAD_SCALERS, components, not_components):
            state[GRAD_SCALERS] = {mid: scaler.state_dict() for mid, scaler in self._grad_scalers.items()}
        return state

    def set_state(self, state):
        super().set_state(state)
        use_configured_lr(self)
        self.num_updates = int(state.get("num_updates", self.num_updates))
        if self.kl_penalty is not None and "ref_kl_coef" in state:
            self.kl_penalty.controller.coef = float(state["ref_kl_coef"])
        if LEARNER_RNG in state:
            self._set_rng_state(state[LEARNER_RNG])
        for mid, saved in state.get(GRAD_SCALERS, {}).items():  # fp16: the loss scale goes on where it was
            if self._grad_scalers and mid in self._grad_scalers:
                self._grad_scalers[mid].load_state_dict(saved)

    def _rng_state(self) -> dict:
        """The generators an update draws from: minibatch shuffles, the MLE pairs, and the
        process's (Python, NumPy, torch), saved with this learner's rank."""
        return {"rank": learner_rank(),
                "minibatch": self._minibatch_rng.bit_generator.state,
                "mle": None if self.mle_pairs is None else self.mle_pairs.rng.bit_generator.state,
                "global": global_rng_state()}

    def restore_generators(self, by_rank: dict) -> None:
        """This learner's own generators from a checkpoint's generators of every learner (by
        rank); a learner with no saved ones (added since) keeps those derived from its rank."""
        saved = by_rank.get(learner_rank())
        if saved is not None:
            self._set_rng_state(saved)

    def _set_rng_state(self, saved: dict) -> None:
        """RLlib checkpoints learner 0's state and gives it to every learner: learner 0 takes the
        saved generators back; the others restart theirs from (seed, rank, updates so far)."""
        if saved["rank"] != learner_rank():
            self._minibatch_rng = np.random.default_rng(self._learner_seed(self.num_updates, 0))
            if self.mle_pairs is not None:
                self.mle_pairs.rng = np.random.default_rng(self._learner_seed(self.num_updates, 1))
            return
        self._minibatch_rng.bit_generator.state = saved["minibatch"]
        if self.mle_pairs is not None and saved["mle"] is not None:
            self.mle_pairs.rng.bit_generator.state = saved["mle"]
        set_global_rng_state(saved["global"])


class TokenLearnerConfig(DeclaredParams, PPOConfig):
    """RLlib's PPOConfig plus the options every token learner reads (reference KL, MLE term),
    attributes and defaults from `TOKEN_TRAINING` and `REFERENCE_KL`."""

    @classmethod
    def declared_params(cls) -> dict:
        return rllib_fields(TOKEN_TRAINING, REFERENCE_KL)

    def build_learner_connector(self, input_observation_space, input_action_space, device=None):
        """RLlib's pipeline, as a `TokenLearnerPipeline`: the same pieces, and the same batch
        from token episodes built by one concatenation per column (`episodes_to_batch`)."""
        return token_learner_pipeline(super().build_learner_connector(input_observation_space, input_action_space,
                                                                      device=device))


class TokenAlgorithm(RemoteRunnerStates, PPO):
    """RLlib's PPO algorithm (its training step) with the colocated weight sync installed."""

    def setup(self, config):
        super().setup(config)
        install_colocated_sync(self)  # one process, one device: weights go device to device
        settle_sync_dtype(self)  # remote EnvRunners that settled bf16 receive bf16
