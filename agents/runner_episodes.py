"""The fast EnvRunner's finished episodes and sampling metrics, at a per-episode cost that
does not dominate a rollout.

`EpisodeBuilder` makes RLlib `SingleAgentEpisode`s from the runner's arrays. RLlib's constructor
checks its inputs and rebuilds each buffer's space structure, about 40 us an episode; here
each episode and buffer is a shallow copy of a template the constructor built once (same
spaces, same flags), with only the per-episode data put in: a new id, the buffers' arrays,
the length. tests/test_rllib_contract.py pins that the copy equals what the constructor makes.

`EpisodeMetrics` gathers a `sample()` call's finished episodes (length, return, seconds) and
logs them once at the call's end, as RLlib's EnvRunners log theirs in `get_metrics`: the same
keys, windows and reductions, each value pushed into its `Stats` object in order (nine
`MetricsLogger.log_value` calls an episode cost about 50 us of Python on a 2-core machine).
"""
from __future__ import annotations

import math
import time
import uuid
from typing import NamedTuple

import numpy as np
from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
from ray.rllib.utils.metrics import (
    EPISODE_DURATION_SEC_MEAN,
    EPISODE_LEN_MAX,
    EPISODE_LEN_MEAN,
    EPISODE_LEN_MIN,
    EPISODE_RETURN_MAX,
    EPISODE_RETURN_MEAN,
    EPISODE_RETURN_MIN,
    NUM_AGENT_STEPS_SAMPLED,
    NUM_AGENT_STEPS_SAMPLED_LIFETIME,
    NUM_ENV_STEPS_SAMPLED,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_EPISODES,
    NUM_EPISODES_LIFETIME,
    NUM_MODULE_STEPS_SAMPLED,
    NUM_MODULE_STEPS_SAMPLED_LIFETIME,
)


class _Copier:
    """New objects of a template's class with the template's attributes (mutable containers copied,
    so no two objects share one): its class's `__slots__` (RLlib's episodes declare them), else
    its `__dict__`."""

    def __init__(self, template):
        self.cls = type(template)
        slots = getattr(self.cls, "__slots__", None)
        names = tuple(slots) if slots is not None else tuple(vars(template))
        values = [(name, getattr(template, name)) for name in names]
        self.plain = [(n, v) for n, v in values if not isinstance(v, (dict, list))]
        self.containers = [(n, v) for n, v in values if isinstance(v, (dict, list))]
        self.slots = slots is not None

    def __call__(self):
        obj = object.__new__(self.cls)
        if self.slots:
            for name, value in self.plain:
                setattr(obj, name, value)
        else:
            obj.__dict__.update(self.plain)
        for name, value in self.containers:
            setattr(obj, name, value.copy())
        return obj


class EpisodeBuilder:
    """Finished, terminated episodes from arrays, in the format RLlib's learner connectors read."""

    def __init__(self, observation_space, action_space, extra_keys=()):
        obs = observation_space.sample()
        self.observation_space, self.action_space, self.extra_keys = observation_space, action_space, tuple(extra_keys)
        self.template = self.construct(
            {k: np.asarray(v)[None].repeat(2, 0) for k, v in obs.items()}, [{}, {}],
            np.zeros(1, dtype=np.int64), np.zeros(1), {k: np.zeros(1, dtype=np.float32) for k in extra_keys})
        t = self.template
        self.new_episode = _Copier(t)
        self.new_buffer = {name: _Copier(getattr(t, name)) for name in ("observations", "infos", "actions", "rewards")}
        self.new_extra = _Copier(InfiniteLookbackBuffer(data=np.zeros(1, dtype=np.float32), lookback=0))

    def construct(self, obs: dict, infos: list, actions, rewards, extras: dict) -> SingleAgentEpisode:
        """The episode through RLlib's constructor (the reference `build` is equal to)."""
        return SingleAgentEpisode(
            observations=InfiniteLookbackBuffer(data=obs, lookback=0, space=self.observation_space),
            infos=infos, actions=InfiniteLookbackBuffer(data=actions, lookback=0, space=self.action_space),
            rewards=InfiniteLookbackBuffer(data=rewards, lookback=0),
            extra_model_outputs={k: InfiniteLookbackBuffer(data=v, lookback=0) for k, v in extras.items()},
            terminated=True, len_lookback_buffer=0,
            observation_space=self.observation_space, action_space=self.action_space)

    @staticmethod
    def _buffer(new, data):
        buf = new()
        buf.data = data
        return buf

    def build(self, obs: dict, infos: list, actions, rewards, extras: dict) -> SingleAgentEpisode:
        """`construct`'s episode: T = len(actions) steps, T + 1 observations and infos."""
        episode = self.new_episode()
        episode.id_ = uuid.uuid4().hex
        for name, data in (("observations", obs), ("infos", infos), ("actions", actions), ("rewards", rewards)):
            setattr(episode, name, self._buffer(self.new_buffer[name], data))
        episode.extra_model_outputs = {k: self._buffer(self.new_extra, v) for k, v in extras.items()}
        episode.t = len(rewards)
        return episode


EPISODE_KEYS = (  # (key, reduce, value index: 0 length, 1 return, 2 seconds)
    (EPISODE_LEN_MEAN, "mean", 0), (EPISODE_RETURN_MEAN, "mean", 1), (EPISODE_DURATION_SEC_MEAN, "mean", 2),
    (("agent_episode_return_mean", DEFAULT_AGENT_ID), "mean", 1),
    (("module_episode_return_mean", DEFAULT_MODULE_ID), "mean", 1),
    (EPISODE_LEN_MIN, "min", 0), (EPISODE_RETURN_MIN, "min", 1),
    (EPISODE_LEN_MAX, "max", 0), (EPISODE_RETURN_MAX, "max", 1),
)


def stats_object(metrics, key):
    """The `Stats` object `metrics.log_value(key, ...)` pushes into (nested dicts for a tuple key)."""
    node = metrics.stats
    for part in (key if isinstance(key, tuple) else (key,)):
        node = node[part]
    return node


class EpisodeMetrics:
    """A call's finished episodes, logged at its end (`flush`) as RLlib's EnvRunners log them."""

    def __init__(self):
        self.episodes: list[tuple] = []

    def add(self, length: int, ret: float, seconds: float) -> None:
        self.episodes.append((length, ret, seconds))

    def flush(self, runner) -> None:
        if not self.episodes:
            return
        episodes, self.episodes = self.episodes, []
        win = max(1, math.ceil(runner.config.metrics_num_episodes_for_smoothing / (runner.config.num_env_runners or 1)))
        metrics = runner.metrics
        for key, reduce, index in EPISODE_KEYS:
            metrics.log_value(key, episodes[0][index], reduce=reduce, window=win)  # creates the Stats where needed
            push = stats_object(metrics, key).push
            for episode in episodes[1:]:
                push(episode[index])


def log_sampled(runner, steps: int, episodes: list) -> None:
    """The sampling counters RLlib's EnvRunners report (same keys and reductions)."""
    runner.num_env_steps_sampled_lifetime += steps
    log = runner.metrics.log_value
    log(NUM_ENV_STEPS_SAMPLED, steps, reduce="sum")
    log((NUM_AGENT_STEPS_SAMPLED, DEFAULT_AGENT_ID), steps, reduce="sum")
    log((NUM_MODULE_STEPS_SAMPLED, DEFAULT_MODULE_ID), steps, reduce="sum")
    log(NUM_EPISODES, len(episodes), reduce="sum")
    log(NUM_ENV_STEPS_SAMPLED_LIFETIME, steps, reduce="lifetime_sum", with_throughput=True)
    log((NUM_AGENT_STEPS_SAMPLED_LIFETIME, DEFAULT_AGENT_ID), steps, reduce="lifetime_sum")
    log((NUM_MODULE_STEPS_SAMPLED_LIFETIME, DEFAULT_MODULE_ID), steps, reduce="lifetime_sum")
    log(NUM_EPISODES_LIFETIME, len(episodes), reduce="lifetime_sum")


def _put(buf, n: int, row: np.ndarray) -> np.ndarray:
    """`buf` (steps, B, ...) with `row` written at step n, grown (doubled) when full."""
    row = np.asarray(row)
    if buf is None:
        buf = np.empty((64,) + row.shape, dtype=row.dtype)
    elif n == len(buf):
        buf = np.concatenate([buf, np.empty_like(buf)])
    buf[n] = row
    return buf


class Rollout:
    """The vector env's rows between module calls: which rows run an episode, where each
    started, and the per-step arrays their episodes are cut from: one (steps, B, ...) buffer per
    column (observation keys, actions, rewards, extra module outputs), the first `n` steps used.
    A row's finished episode is noted (`finish`) before the row restarts and cut from the arrays
    later (`episode_arrays`), while the module's next steps run on its device: the steps it covers
    stay as they are until the next `trim`."""

    def __init__(self, num_rows: int, explore: bool):
        B = num_rows
        self.explore = explore
        self.obs = None
        self.cont = np.zeros(B, dtype=bool)  # rows whose next module input continues the last one
        self.active = np.zeros(B, dtype=bool)
        self.ever_started = np.zeros(B, dtype=bool)
        self.row_start = np.zeros(B, dtype=np.int64)
        self.start_time = np.zeros(B, dtype=np.float64)
        self.reset_infos: list[dict] = [{} for _ in range(B)]
        self.n = 0
        self.obs_buf, self.act_buf, self.rew_buf, self.extra_buf = {}, None, None, {}

    def record(self, obs: dict, actions, rewards, extras: dict) -> None:
        """One vector step: the observations the module saw, the actions, rewards and extra outputs."""
        n = self.n
        for k, v in obs.items():
            self.obs_buf[k] = _put(self.obs_buf.get(k), n, v)
        self.act_buf, self.rew_buf = _put(self.act_buf, n, actions), _put(self.rew_buf, n, rewards)
        for k, v in extras.items():
            self.extra_buf[k] = _put(self.extra_buf.get(k), n, v)
        self.n = n + 1

    def trim(self) -> None:
        """Drops the steps before the oldest running episode's first."""
        s0 = int(self.row_start[self.active].min()) if self.active.any() else self.n
        if s0 > 0:
            bufs = [*self.obs_buf.values(), self.act_buf, self.rew_buf, *self.extra_buf.values()]
            for buf in bufs:
                if buf is not None:
                    buf[:self.n - s0] = buf[s0:self.n].copy()
            self.n -= s0
            self.row_start -= s0

    def finish(self, i: int, final_info: dict) -> "FinishedRow":
        """Row i's episode, ended at the last step recorded: what of it a restart overwrites (the
        last observation, the reset info, the clock) kept now."""
        return FinishedRow(int(i), int(self.row_start[i]), self.n, {k: v[i].copy() for k, v in self.obs.items()},
                           self.reset_infos[i], final_info, time.perf_counter() - self.start_time[i])

    def episode_arrays(self, row: "FinishedRow") -> tuple:
        """A finished row's observations (T + 1), actions, rewards and extra outputs (T), copied out
        of the arrays (which later steps write again)."""
        i, s, n = row.index, row.start, row.end
        obs = {k: np.concatenate([b[s:n, i], row.last_obs[k][None]]) for k, b in self.obs_buf.items()}
        return (obs, self.act_buf[s:n, i].astype(np.int64), self.rew_buf[s:n, i].astype(np.float64),
                {k: b[s:n, i].copy() for k, b in self.extra_buf.items()})


class FinishedRow(NamedTuple):
    """A row's finished episode as `Rollout.finish` notes it: the row, its first and last + 1 steps
    in the arrays, its last observation, reset and final infos, and its seconds."""
    index: int
    start: int
    end: int
    last_obs: dict
    reset_info: dict
    final_info: dict
    seconds: float

    @property
    def steps(self) -> int:
        return self.end - self.start

