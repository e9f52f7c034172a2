"""Learning on whole sequences instead of isolated token steps.

Every stored step's observation is a prefix of its episode's final sequence
(the transition is a deterministic append). So one forward pass over the
final sequence gives the logits and values of all of its steps; recomputing
each step's prefix separately costs O(T^2) per sequence instead of O(T).

`AddSequenceIds` tags every row of the learner batch with its episode's index;
`sequence_minibatches` cuts the batch into minibatches of whole sequences, so
the module (`CausalLMActorCritic`) runs each sequence once per minibatch.
"""
from __future__ import annotations

import itertools
from contextlib import nullcontext

import numpy as np
import torch
import tree

from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.connectors.learner import (
    AddColumnsFromEpisodesToTrainBatch,
    AddObservationsFromEpisodesToBatch,
    AddOneTsToEpisodesAndTruncate,
    AddStatesFromEpisodesToBatch,
    AddTimeDimToBatchAndZeroPad,
    BatchIndividualItems,
    LearnerConnectorPipeline,
    NumpyToTensor,
)
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModule
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.metrics import (
    ALL_MODULES,
    CONNECTOR_PIPELINE_TIMER,
    LEARNER_CONNECTOR,
    LEARNER_CONNECTOR_SUM_EPISODES_LENGTH_IN,
    LEARNER_CONNECTOR_SUM_EPISODES_LENGTH_OUT,
)
from ray.rllib.utils.torch_utils import convert_to_torch_tensor

from agents.core import SEQ_ID


class AddSequenceIds(ConnectorV2):
    """Learner connector piece: adds `seq_id` (the row's episode index) to each module batch."""

    def __call__(self, *, rl_module, batch, episodes, **kwargs):
        lens = [len(e) for e in self.single_agent_episode_iterator(episodes, agents_that_stepped_only=False)]
        for module_id, module_batch in batch.items():
            ids = np.repeat(np.arange(len(lens)), lens)
            rows = len(module_batch["actions"])
            if len(ids) != rows:  # multi-module batches: leave grouping off rather than guess
                continue
            device = module_batch["actions"].device
            module_batch[SEQ_ID] = torch.as_tensor(ids, device=device)
        return batch


class AddOneTsToUnfinishedEpisodes(AddOneTsToEpisodesAndTruncate):
    """Learner connector piece in place of RLlib's `AddOneTsToEpisodesAndTruncate` (PPO family).

    RLlib appends an artificial step to every episode, so that GAE's value pass also yields
    V(s_T), the bootstrap value of an episode cut short, and masks that row out of the loss.
    A terminated episode needs no bootstrap value (it is 0), and a token episode always ends
    terminated (EOS or the horizon; both runners return whole episodes). Where every episode
    of the batch is terminated, this piece adds the columns RLlib's piece adds (the loss mask,
    all true; `terminateds` true at the last step; `truncateds` false) and no step. GAE then
    sees the same rewards, values and episode boundaries, the learner forwards and masks one
    row fewer per episode, and advantages are standardized over the loss steps only (RLlib's
    standardization also counts the artificial rows). Otherwise it is RLlib's piece.
    """

    def __call__(self, *, rl_module, batch, episodes, explore=None, shared_data=None, **kwargs):
        sa_episodes = list(self.single_agent_episode_iterator(episodes, agents_that_stepped_only=False))
        if (not sa_episodes or isinstance(episodes[0], MultiAgentEpisode)
                or not all(e.is_terminated and len(e) > 0 for e in sa_episodes)):
            return super().__call__(rl_module=rl_module, batch=batch, episodes=episodes, explore=explore,
                                    shared_data=shared_data, **kwargs)
        for i, episode in enumerate(sa_episodes):
            episode.id_ += "_" + str(i)  # as RLlib's piece: ids stay unique within the batch
            n = len(episode)
            last = np.zeros(n, dtype=bool)
            last[-1] = True
            self.add_n_batch_items(batch, Columns.LOSS_MASK, np.ones(n, dtype=bool), n, episode)
            self.add_n_batch_items(batch, Columns.TERMINATEDS, last, n, episode)
            self.add_n_batch_items(batch, Columns.TRUNCATEDS, np.zeros(n, dtype=bool), n, episode)
        if shared_data is not None:
            shared_data["_added_loss_mask_for_valid_episode_ts"] = True
        return batch


# The pieces of the PPO family's learner pipeline that only turn episodes into the train batch:
# RLlib's default pieces (single-agent, ending with NumpyToTensor) after AddOneTsToUnfinishedEpisodes.
EPISODES_TO_BATCH = (AddOneTsToUnfinishedEpisodes, AddObservationsFromEpisodesToBatch,
                     AddColumnsFromEpisodesToTrainBatch, AddTimeDimToBatchAndZeroPad,
                     AddStatesFromEpisodesToBatch, BatchIndividualItems, NumpyToTensor)


# Batch columns the episodes-to-batch pieces make themselves or never copy from a model output.
RESERVED_COLUMNS = frozenset({Columns.OBS, Columns.ACTIONS, Columns.REWARDS, Columns.TERMINATEDS,
                              Columns.TRUNCATEDS, Columns.LOSS_MASK, Columns.STATE_IN, Columns.STATE_OUT,
                              Columns.INFOS, SEQ_ID})


def _arrays(buffer, n: int):
    """The first n items of an episode's buffer with no lookback (a dict of arrays for a dict
    space), or None where it holds something else (a list, a lookback)."""
    if buffer.lookback != 0:
        return None
    data = buffer.data
    if isinstance(data, dict):
        return {k: v[:n] for k, v in data.items()} if all(isinstance(v, np.ndarray) for v in data.values()) else None
    return data[:n] if isinstance(data, np.ndarray) else None


def _episode_arrays(rl_module, episodes):
    """(module id, [(observations, {column: array})] per episode) where `episodes_to_batch`
    covers them: one stateless module, single-agent episodes that all terminated, numpy
    buffers with no lookback and the same columns in every episode; else None."""
    if not isinstance(rl_module, MultiRLModule) or len(rl_module) != 1 or not episodes:
        return None
    module_id, module = next(iter(rl_module.items()))
    if module.is_stateful():
        return None
    out, keys = [], None
    for e in episodes:
        n = len(e)
        if (type(e) is not SingleAgentEpisode or not e.is_terminated or n == 0
                or e.module_id not in (None, module_id)):
            return None
        obs = _arrays(e.observations, n)
        if RESERVED_COLUMNS & e.extra_model_outputs.keys():  # RLlib's pieces skip these; leave it to them
            return None
        cols = {Columns.ACTIONS: _arrays(e.actions, n), Columns.REWARDS: _arrays(e.rewards, n),
                **{k: _arrays(b, n) for k, b in e.extra_model_outputs.items()}}
        if obs is None or any(v is None or isinstance(v, dict) for v in cols.values()):
            return None
        layout = (type(obs), tuple(obs) if isinstance(obs, dict) else None, tuple(cols))
        if keys is not None and layout != keys:
            return None
        keys = layout
        out.append((obs, cols))
    return module_id, out


def episodes_to_batch(rl_module, arrays) -> dict:
    """The train batch RLlib's default learner pieces (`EPISODES_TO_BATCH`, with
    `AddOneTsToUnfinishedEpisodes`) make of the episodes whose arrays `_episode_arrays` gave,
    built by one concatenation per column. The sequence ids are `AddSequenceIds`', after it.
    The pieces took a few tens of microseconds per episode (one-off timing)."""
    module_id, per_episode = arrays
    lens = np.array([len(cols[Columns.ACTIONS]) for _, cols in per_episode])
    total = int(lens.sum())
    last = np.zeros(total, dtype=bool)
    last[np.cumsum(lens) - 1] = True
    first_obs = per_episode[0][0]
    if isinstance(first_obs, dict):
        obs = {k: np.concatenate([o[k] for o, _ in per_episode]) for k in first_obs}
    else:
        obs = np.concatenate([o for o, _ in per_episode])
    data = {Columns.LOSS_MASK: np.ones(total, dtype=bool), Columns.TERMINATEDS: last,
            Columns.TRUNCATEDS: np.zeros(total, dtype=bool), Columns.OBS: obs,
            **{k: np.concatenate([cols[k] for _, cols in per_episode]) for k in per_episode[0][1]}}
    device = next(iter(rl_module[module_id].parameters()), torch.empty(0)).device
    return {module_id: convert_to_torch_tensor(data, device=device)}


class TokenLearnerPipeline(LearnerConnectorPipeline):
    """The learner pipeline of the PPO family. Where its first pieces are exactly RLlib's
    default episodes-to-batch pieces (`EPISODES_TO_BATCH`, in that order) and the
    episodes are what `episodes_to_batch` covers (both EnvRunners' token episodes), those
    pieces are replaced by `episodes_to_batch`: the same batch, built in one pass over arrays.
    The pieces after them (sequence ids, the KL penalty, GAE, ...) run as usual. Any other
    pipeline (e.g. with a custom piece in front) or episode runs every piece."""

    def _rest(self):
        """The pieces after the episodes-to-batch prefix, or None where the pipeline does not
        start with exactly that prefix."""
        cut = next((i for i, c in enumerate(self.connectors) if type(c) is NumpyToTensor), None)
        if cut is None or [type(c) for c in self.connectors[:cut + 1]] != list(EPISODES_TO_BATCH):
            return None
        return self.connectors[cut + 1:]

    def __call__(self, *, rl_module, batch=None, episodes, explore=False, shared_data=None, metrics=None,
                 **kwargs):
        rest = self._rest() if not batch else None
        arrays = _episode_arrays(rl_module, episodes) if rest is not None else None
        if arrays is None:
            return super().__call__(rl_module=rl_module, batch=batch, episodes=episodes, explore=explore,
                                    shared_data=shared_data, metrics=metrics, **kwargs)
        shared_data = shared_data if shared_data is not None else {}
        shared_data["_added_loss_mask_for_valid_episode_ts"] = True  # as AddOneTsToUnfinishedEpisodes
        n = sum(map(len, episodes))
        if metrics:
            metrics.log_value((ALL_MODULES, LEARNER_CONNECTOR_SUM_EPISODES_LENGTH_IN), n)
        # the pipeline's timer (as RLlib's pipeline logs it), from the arrays' concatenation on
        with metrics.log_time((ALL_MODULES, LEARNER_CONNECTOR, CONNECTOR_PIPELINE_TIMER)) if metrics else nullcontext():
            batch = episodes_to_batch(rl_module, arrays)
            for connector in rest:
                batch = connector(rl_module=rl_module, batch=batch, episodes=episodes, explore=explore,
                                  shared_data=shared_data, metrics=metrics, **kwargs)
        if metrics:
            metrics.log_value((ALL_MODULES, LEARNER_CONNECTOR_SUM_EPISODES_LENGTH_OUT), n)
        return batch


def token_learner_pipeline(pipeline: LearnerConnectorPipeline) -> TokenLearnerPipeline:
    """`pipeline`'s pieces in a `TokenLearnerPipeline`."""
    return TokenLearnerPipeline(connectors=list(pipeline.connectors),
                                input_observation_space=pipeline.input_observation_space,
                                input_action_space=pipeline.input_action_space)


def sequence_minibatches(batch: MultiAgentBatch, *, num_epochs: int, minibatch_size: int | None,
                         shuffle: bool, rng: np.random.Generator, num_total_minibatches: int = 0):
    """Yields `num_epochs` passes over `batch` in minibatches of whole sequences.

    A minibatch takes sequences until it holds at least `minibatch_size` steps.
    The sequences left over at the end of an epoch make a minibatch of their own
    if they hold at least half of `minibatch_size` steps, else they join the
    epoch's last minibatch: no Adam step is taken on a few leftover sequences
    (a batch of 1,300 steps with minibatches of 1,280 is one update, not a full
    one and one on 20 steps). Without `seq_id` it falls back to one-row groups.

    With several learners RLlib passes `num_total_minibatches`: every learner must
    run exactly that many gradient steps (each one all-reduces gradients), whatever
    its shard's size. Then the passes continue, reshuffled, until that many
    minibatches were yielded, and stop there.
    """
    if num_total_minibatches > 0:
        def passes():
            while True:
                yield from _one_pass(batch, minibatch_size=minibatch_size, shuffle=shuffle, rng=rng)

        yield from itertools.islice(passes(), num_total_minibatches)
    else:
        for _ in range(num_epochs):
            yield from _one_pass(batch, minibatch_size=minibatch_size, shuffle=shuffle, rng=rng)


def _one_pass(batch: MultiAgentBatch, *, minibatch_size, shuffle, rng):
    """One epoch: every sequence of every module once, in minibatches of whole sequences."""
    per_module = {}
    for module_id, module_batch in batch.policy_batches.items():
        rows = len(module_batch)
        if SEQ_ID in module_batch:
            seq_ids = module_batch[SEQ_ID].cpu().numpy()
            starts = np.flatnonzero(np.r_[True, seq_ids[1:] != seq_ids[:-1]])
            groups = np.split(np.arange(rows), starts[1:])
        else:
            groups = [np.arange(rows)[i:i + 1] for i in range(rows)]
        order = rng.permutation(len(groups)) if shuffle else np.arange(len(groups))
        chunks, current, size = [], [], 0
        for g in order:
            current.append(groups[g])
            size += len(groups[g])
            if minibatch_size and size >= minibatch_size:
                chunks.append(np.concatenate(current))
                current, size = [], 0
        if current:  # the sequences left over: a minibatch of their own only if at least half full
            if chunks and minibatch_size and 2 * size < minibatch_size:
                chunks[-1] = np.concatenate([chunks[-1], *current])
            else:
                chunks.append(np.concatenate(current))
        per_module[module_id] = (module_batch, chunks)
    n = max(len(chunks) for _, chunks in per_module.values())
    for i in range(n):
        mini = {}
        for module_id, (module_batch, chunks) in per_module.items():
            idx = torch.as_tensor(chunks[i % len(chunks)])
            mini[module_id] = SampleBatch(
                tree.map_structure(lambda v: v[idx.to(v.device)] if torch.is_tensor(v) else v[idx.numpy()],
                                   dict(module_batch))
            )
        yield MultiAgentBatch(mini, env_steps=max(len(b) for b in mini.values()))
