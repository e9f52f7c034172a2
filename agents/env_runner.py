"""EnvRunners for the token env.

`FastTokenEnvRunner` (`env_runners.runner: fast`; the default `auto` picks it for every algorithm
but DQN, which takes the stock runner) samples whole episodes from `TokenGenerationVectorEnv` with
no per-step connector pipeline and no per-row Python in the token loop. Per decode block (k vector
steps, `env_runners.decode_block`, 4 unless set) it makes one batched module call and k batched env
steps:

  * the module gets every row's window plus `ROW_CONTINUES` (which rows
    continue the previous call's), so its KV cache, mirostat state and guide
    plans carry on by construction, and only rows that (re)started are prefilled;
  * rows whose episode ended wait (the env leaves them as they are, autoreset
    DISABLED) until a quarter of the rows are free, then they restart together,
    so refills share one prefill pass; where the last rows that started all
    began on windows seen since the last weight sync (prompts that repeat), the
    module's cache holds their prefill (`agents.modules.kv_cache`), a restart
    costs no pass, and finished rows restart at once (at the block's end);
  * an RLlib `SingleAgentEpisode` is built once per finished episode, from
    arrays, in the format RLlib's learner connectors consume (with decode
    blocks, once the module's next block is queued: on a GPU while the
    device computes it);
  * with `env_runners.decode_block` k > 1 (4 unless set) the module runs k steps per call
    (`act_steps`, exploring or greedy: each row appends the token it took, on the
    module's device) and the env then steps through them: one host round trip per k tokens.
    A training call ends at a block's end, so it may sample up to k-1 steps of every row past
    its share (docs/results/host_time.md has the steps per iteration).

A training call (`sample()` with no arguments, or `num_timesteps`) samples
at least the EnvRunner's share of the train batch (`train_batch_size /
num_env_runners` env steps), returns complete episodes holding at least that
many, and carries the episodes still running over to the next call, so no call waits for its slowest rows. A
carried episode may thus span a weight sync: its early steps keep the
log-probs of the weights that sampled them (PPO's ratio is taken against
those), and the module re-prefills its cache with the new weights. With
`env_runners.carry_episodes: false` a training call instead starts no episode
once it has sampled its share and finishes the running ones: every batch is
sampled by one set of weights (as the stock runner's complete episodes), at the
cost of rows idling while the last episodes finish. A count of
episodes (`num_episodes`, e.g. evaluation) starts and finishes its own. The
env is seeded once, at the first reset (config seed, the EnvRunner's index and
the row), so runs repeat and every call draws new prompts.
Callbacks: `on_sample_end` and `on_episode_end` (the others are per step and
are not called here). `on_episode_end` runs when the episode is built, with
decode blocks once the module's next block is queued: by then the episode's
env row may have restarted on a new prompt (the episode holds all of its own data). Weight syncs go through RLlib's `set_state` (the module
drops its caches there).

`StockTokenEnvRunner` (`env_runners.runner: stock`) is RLlib's own
`SingleAgentEnvRunner` over the single-row env, kept for comparison and for
DQN (which samples n-step fragments, not whole episodes). With
`batch_mode: complete_episodes` RLlib 2.60 resets every vector env at the start
of each `sample()` call with the same seed, so every call would replay the same
`num_envs_per_env_runner` prompts; the k-th seeded reset of an EnvRunner uses
`seed + k * SEED_STRIDE` instead.

Seeds and checkpoints. Everything an EnvRunner draws from derives from the config's
`seed` and the EnvRunner's index: RLlib seeds the process's `random`, NumPy and torch
generators with `seed + worker_index` (+1e6 for evaluation), the env rows with the
seeds above, and the module's rollout generators (the sampling generator, on the module's
device, which nothing else in the process draws from; guide roll-in plans, an LM guide's
sampling) get `rollout_seed(seed, index)`. Building the module cannot disturb the
process's generators (it runs inside `torch.random.fork_rng`). `get_state` adds
`ROLLOUT_STATE`: those generators' states, the env (each row's generator and the
episode it is in), the episodes a `FastTokenEnvRunner` carries to its next call (its
`Rollout`) and the module's per-row rollout state. RLlib saves the local EnvRunner's
state in algorithm checkpoints, so with `num_env_runners: 0` a resumed run goes on
exactly as an uninterrupted one. RLlib saves no remote EnvRunner's state; the project's
algorithms add each one's to the checkpoint and restore it (`RemoteRunnerStates` in
agents/algorithms/base.py), so a run with remote EnvRunners resumes exactly too.
"""
from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch

from ray.rllib.callbacks.utils import make_callback
from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.core.columns import Columns
from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner
from ray.rllib.utils import force_list
from ray.rllib.utils.metrics import SAMPLE_TIMER, WEIGHTS_SEQ_NO

from agents.core import ROLLOUT_STATE, ROW_CONTINUES, global_rng_state, set_global_rng_state, state_requested
from agents.modules.host_transfers import HostTransfers
from agents.runner_episodes import EpisodeBuilder, EpisodeMetrics, Rollout, log_sampled
from agents.rollout_state import (_module_rollout_states, _seed_module_rollouts, _set_module_rollout_states,
                                  env_state, rollout_seed, sampling_state, set_env_state, set_sampling_state)
from agents.weight_sync import COLOCATED, modules_by_id
from env.text_env import RepeatedPromptEnv, TokenGenerationEnv
from env.vector_env import TokenGenerationVectorEnv, row_info

SEED_STRIDE = 1_000_003  # far apart from the per-sub-env (+i) and per-EnvRunner (+index) offsets
TOKEN_ENV = "token_generation"  # the name `make_token_env` is registered under (ray.tune.register_env)
CARRY_EPISODES = "carry_episodes"  # env_config key: env_runners.carry_episodes (FastTokenEnvRunner)
DECODE_BLOCK = "decode_block"  # env_config key: env_runners.decode_block (FastTokenEnvRunner)
COMPILE_STEP = "compile_step"  # env_config key: env_runners.compile_step (FastTokenEnvRunner)
SEEN_WINDOWS_MAX = 100_000  # windows remembered per weight version (for the restart schedule only)
# env_runners.decode_block unset: module steps per env round trip, on every device. On an H100 (PPO
# at GPT-2-small shape, 20-token episodes, one run each) sampling took 128, 93, 99 and 142 ms per
# iteration at 1, 4, 8 and 16 (docs/results/gpu.md); on 2 CPU cores PPO made 0-15% more tokens/s
# than at 1 (by settings), and the quickstart's seeds 0-7 passed 0.9 in a median of 52 iterations
# against 57.5 (docs/results/host_time.md)
DEFAULT_DECODE_BLOCK = 4


def decode_block_for(configured: int | None) -> int:
    """Module steps per env round trip: `env_runners.decode_block` where set, else the default."""
    return configured or DEFAULT_DECODE_BLOCK


def steps_per_round_trip(module, configured: int | None, explore: bool) -> int:
    """The module steps a fast EnvRunner takes per env round trip: `decode_block_for(configured)`
    where the module acts in blocks (greedy, or exploring with no guide), else 1."""
    block = decode_block_for(configured)
    return block if block > 1 and module.can_act_in_blocks(explore) else 1


def runner_decode_block(runner) -> int:
    """The module steps per env round trip an EnvRunner takes while exploring (the stock one: 1)."""
    if not isinstance(runner, FastTokenEnvRunner) or runner.module is None:
        return 1
    return steps_per_round_trip(runner.module, runner._block, explore=True)


class _SeededRunnerMixin:
    """Module building that leaves the process's generators alone, per-EnvRunner rollout
    seeds, and the generators' and env's states in `get_state`/`set_state`."""

    def make_module(self):
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):  # a module seeding torch must not reset this runner's stream
            super().make_module()
        if self.config.seed is not None and self.module is not None:
            index = (self.worker_index or 0) + (1_000_000 if self.config.in_evaluation else 0)
            _seed_module_rollouts(self.module, rollout_seed(self.config.seed, index))
        for module in (modules_by_id(self.module).values() if self.module is not None else ()):
            if hasattr(module, "settle_rollout_precision"):  # env_runners.precision auto: on RLlib's device now
                module.settle_rollout_precision()

    def _runner_id(self) -> tuple:
        return int(self.worker_index or 0), bool(self.config.in_evaluation)

    def _rollout_state(self) -> dict:
        return {"runner": self._runner_id(), "rng": global_rng_state(),
                "env": env_state(self.env) if self.env is not None else None,
                "module": _module_rollout_states(self.module), "metrics": self.metrics.get_state()}

    def _set_rollout_state(self, state: dict) -> None:
        set_global_rng_state(state["rng"])
        if state["env"] is not None and self.env is not None:
            set_env_state(self.env, state["env"])
        _set_module_rollout_states(self.module, state["module"])
        self.metrics.set_state(state["metrics"])

    def get_state(self, components=None, *, not_components=None, **kwargs):
        state = super().get_state(components, not_components=not_components, **kwargs)
        if state_requested(ROLLOUT_STATE, components, not_components):
            state[ROLLOUT_STATE] = self._rollout_state()
        return state

    # -- weight syncs to the driver's EnvRunner while remote ones sample: applied when used --------

    hold_back_syncs = True  # False: the driver's EnvRunner loads every sync at once (RLlib's way)

    @property
    def module(self):
        """The RLModule, with a weight sync held back (`set_state`) applied first."""
        pending = self.__dict__.get("_pending_sync")
        if pending is not None:
            self.__dict__["_pending_sync"] = None
            self.__dict__["_applying_sync"] = True
            try:
                self.set_state(pending)
            finally:
                self.__dict__["_applying_sync"] = False
        return self.__dict__.get("_module")

    @module.setter
    def module(self, value) -> None:
        self.__dict__["_module"] = value

    def _holds_back(self, state) -> bool:
        """Whether `state` is a weight sync to the driver's training EnvRunner while remote ones
        sample: the copy waits until its module is next used (a checkpoint, `get_module`, a sample)."""
        return (self.hold_back_syncs and not self.__dict__.get("_applying_sync") and (self.worker_index or 0) == 0
                and not self.config.in_evaluation and self.config.num_env_runners > 0
                and COMPONENT_RL_MODULE in state and ROLLOUT_STATE not in state)

    def set_state(self, state) -> None:
        if self._holds_back(state):
            self.__dict__["_pending_sync"] = state
            return
        if COMPONENT_RL_MODULE in state:  # newer weights replace any held back
            self.__dict__["_pending_sync"] = None
        super().set_state(state)
        saved = state.get(ROLLOUT_STATE)  # a checkpoint's; weight syncs carry none
        # Only this EnvRunner's own (RLlib hands evaluation runners the training runner's state).
        if saved is not None and tuple(saved["runner"]) == self._runner_id():
            self._set_rollout_state(saved)


def make_token_env(config):
    """RLlib's env creator: one row (`TokenGenerationEnv`, or the `repeat_prompt` env of
    REINFORCE) or, when RLlib's vector entry point asks for `num_envs`, the vector env of
    such rows."""
    cfg = dict(config or {})
    row_cls = TokenGenerationEnv
    if "repeat_prompt" in cfg:
        row_cls = RepeatedPromptEnv
    cfg.pop(CARRY_EPISODES, None)  # the fast EnvRunner's settings, not the env's
    cfg.pop(DECODE_BLOCK, None)
    cfg.pop(COMPILE_STEP, None)
    cfg.pop(COLOCATED, None)  # the algorithm's (agents.weight_sync)
    if "num_envs" in cfg:
        return TokenGenerationVectorEnv(cfg, row_env_cls=row_cls)
    cfg.pop("autoreset_mode", None)
    return row_cls(cfg)


def compile_rollout_step(cache, env_config: dict) -> None:
    """`env_runners.compile_step` onto this runner's rollout cache (generate and serve never compile)."""
    if hasattr(cache, "compile_step"):
        cache.compile_step = bool(env_config.get(COMPILE_STEP, False))


class RestartSchedule:
    """When the fast EnvRunner restarts finished rows: at once where a restart costs no pass of its
    own, else once a quarter of the rows are free, so restarts share one prefill pass. A restart
    is free where the cache prefills restarting rows inside its captured step, or where the last
    rows that started all began on windows seen since the last weight sync: a cache keeping
    prefills by window (agents.modules.kv_cache) then holds theirs. (Cache on or off alike.)"""

    def __init__(self, cache, has_module: bool):
        self.cache = cache
        self.reuses_prefills = has_module and (cache is None or hasattr(cache, "store"))
        self.seen: set[bytes] = set()  # windows rows started on since the last weight sync
        self.free = False

    def note_windows(self, obs: dict, rows: np.ndarray) -> None:
        # A cache told not to reuse prefills (`reuse_prefills = False`, as if every prompt
        # differed) gets the schedule of distinct prompts: restarts wait and share a pass.
        if not self.reuses_prefills or not getattr(self.cache, "reuse_prefills", True):
            return
        keys = [obs["input_ids"][i].tobytes() + obs["attention_mask"][i].tobytes() for i in rows]
        self.free = getattr(self.cache, "restarts_in_step", False) or all(k in self.seen for k in keys)
        if len(self.seen) > SEEN_WINDOWS_MAX:
            self.seen.clear()
        self.seen.update(keys)

    def weights_changed(self) -> None:
        self.seen.clear()
        self.free = False


class FastTokenEnvRunner(_SeededRunnerMixin, SingleAgentEnvRunner):
    samples_on_module_device = True  # wherever a colocated sync puts its module (agents.weight_sync)

    def __init__(self, *, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self._episode_callbacks = [cls() for cls in force_list(self.config.callbacks_class)]
        self._env_seeded = False
        self._rollout = None  # unfinished episodes carried from one sample() call to the next
        self._carry = bool(self.config.env_config.get(CARRY_EPISODES, True))
        self._block = self.config.env_config.get(DECODE_BLOCK)  # None: DEFAULT_DECODE_BLOCK
        self._cache = getattr(self.module, "kv_cache", None) if self.module is not None else None
        compile_rollout_step(self._cache, self.config.env_config)
        self._restarts = RestartSchedule(self._cache, self.module is not None)
        self._host = HostTransfers()
        self._episode_metrics = EpisodeMetrics()
        self._episode_builder = None  # made at the first finished episode (its extra output keys)

    def set_state(self, state) -> None:
        super().set_state(state)
        if COMPONENT_RL_MODULE in state and self.__dict__.get("_pending_sync") is None:
            self.weights_changed()

    def weights_changed(self) -> None:
        """New weights (RLlib's sync or a colocated one): the module's stored prefills are gone."""
        self._restarts.weights_changed()

    def _vector_env(self) -> TokenGenerationVectorEnv:
        env = self.env.unwrapped
        if not isinstance(env, TokenGenerationVectorEnv):
            raise TypeError(f"FastTokenEnvRunner needs a TokenGenerationVectorEnv, got {type(env).__name__} "
                            "(set env_runners.runner: stock for other envs)")
        return env

    def _rollout_state(self) -> dict:
        """Adds the episodes carried to the next sample() call: a resumed run finishes them as an
        uninterrupted one would (their early steps keep the log-probs they were sampled with)."""
        return {**super()._rollout_state(), "carried": copy.deepcopy(self._rollout), "env_seeded": self._env_seeded}

    def _set_rollout_state(self, state: dict) -> None:
        super()._set_rollout_state(state)
        self._rollout, self._env_seeded = copy.deepcopy(state["carried"]), state["env_seeded"]
        if self._rollout is not None:  # episode durations restart in this process's clock
            self._rollout.start_time[:] = time.perf_counter()

    def _first_seed(self):
        if self._env_seeded or self.config.seed is None:
            return None
        self._env_seeded = True
        index = (self.worker_index or 0) + (1_000 if self.config.in_evaluation else 0)
        return int(self.config.seed) + index * self.config.num_envs_per_env_runner

    def sample(self, *, num_timesteps=None, num_episodes=None, explore=None, random_actions=False,
               force_reset=False):
        """Complete episodes: at least `num_episodes` of them, or at least `num_timesteps` steps
        (default: this EnvRunner's share of the train batch; unfinished episodes go on in the
        next such call). `force_reset` changes nothing."""
        if self.env is None:
            raise ValueError(f"{self} doesn't have an env! Can't call `sample()` on it.")
        if num_timesteps is not None and num_episodes is not None:
            raise ValueError("sample(): give num_timesteps or num_episodes, not both")
        explore = self.config.explore if explore is None else explore
        if num_timesteps is None and num_episodes is None:
            num_timesteps = math.ceil(self.config.total_train_batch_size / max(1, self.config.num_env_runners))
        self._episode_metrics = EpisodeMetrics()  # nothing left from a call that raised
        self.metrics.log_value(WEIGHTS_SEQ_NO, self._weights_seq_no, window=1)  # the weights' version, as RLlib's
        with self.metrics.log_time(SAMPLE_TIMER):
            episodes, steps = self._sample_episodes(num_timesteps, num_episodes, explore, random_actions)
            self._episode_metrics.flush(self)
            make_callback("on_sample_end", callbacks_objects=self._episode_callbacks,
                          callbacks_functions=self.config.callbacks_on_sample_end,
                          kwargs=dict(env_runner=self, metrics_logger=self.metrics, samples=episodes))
        log_sampled(self, steps, episodes)
        return episodes

    @torch.no_grad()
    def _sample_episodes(self, num_timesteps, num_episodes, explore, random_actions):
        env = self._vector_env()
        B = env.num_envs
        module = self.module
        device = next(module.parameters()).device if module is not None else torch.device("cpu")
        refill_at = max(1, B // 4)
        by_steps = num_timesteps is not None
        # Training calls (a number of steps) carry unfinished episodes over to the next call (no call
        # waits for its slowest rows), unless carry_episodes is off: then they drain, finishing them.
        # A count of episodes (evaluation) starts and finishes its own.
        draining = by_steps and not self._carry
        st = self._rollout if by_steps and not random_actions else None
        self._rollout = None
        if st is None or st.explore != explore:
            st = Rollout(B, explore)
        else:
            st.trim()
        episodes, returned, started, steps = [], 0, 0, 0
        finished = []  # rows' finished episodes, built while the module's next steps run (`_build`)

        def start(rows: np.ndarray) -> None:
            nonlocal started
            mask = np.zeros(B, dtype=bool)
            mask[rows] = True
            st.obs, infos = env.reset(seed=self._first_seed(), options={"reset_mask": mask})
            for i in rows:
                st.reset_infos[i] = row_info(infos, i)
            self._restarts.note_windows(st.obs, rows)
            st.row_start[rows], st.start_time[rows] = st.n, time.perf_counter()
            st.active[rows] = st.ever_started[rows] = True
            st.cont[rows] = False
            started += len(rows)

        def refill(at_least: int) -> None:
            free = np.flatnonzero(~st.active)
            if draining:  # only as many rows as the call's share may still need at full length
                running = int((st.n - st.row_start[st.active]).sum())  # steps the running rows took
                short = num_timesteps - steps - (int(st.active.sum()) * env.max_new_tokens - running)
                n = min(len(free), max(0, math.ceil(short / env.max_new_tokens)))
            else:
                n = len(free) if by_steps else min(len(free), num_episodes - started)
            if n > 0 and len(free) >= at_least:
                start(free[:n])

        refill(1)
        build = lambda: self._build(st, finished, episodes)  # noqa: E731
        t_global = self.num_env_steps_sampled_lifetime
        # A training call both samples and returns at least its share: RLlib's sampling loop counts
        # the steps sampled (NUM_ENV_STEPS_SAMPLED), and a call whose returned episodes were partly
        # sampled by the call before would otherwise be followed by a second call in the same
        # iteration (about 1.5x the configured train batch on average, 2x at worst).
        while ((steps < num_timesteps or st.active.any()) if draining
               else (min(returned, steps) < num_timesteps) if by_steps else st.active.any()):
            for out in self._module_steps(st, module, env, explore, random_actions, device, t_global + steps, build):
                actions = out.pop(Columns.ACTIONS)
                before = st.obs
                st.obs, rewards, terminated, _, infos = env.step(actions)
                st.record(before, actions, rewards, out)
                steps += int(st.active.sum())
                for i in np.flatnonzero(terminated & st.active):
                    finished.append(st.finish(i, row_info(infos, i)))
                    returned += finished[-1].steps
                    st.active[i] = False
                st.cont[:] = True  # idle rows run along (their outputs are ignored) until they restart
                if not st.active.any():  # the rest of a block: no row runs an episode any more
                    break
            refill(1 if self._restarts.free or not st.active.any() else refill_at)
        build()
        if by_steps and not random_actions:
            self._rollout = st  # with carry_episodes off it holds no running episode, only buffers
        return episodes, steps

    def _build(self, st, finished: list, episodes: list) -> None:
        """The episodes of the rows in `finished` (emptied), in the order they finished."""
        episodes.extend(self._episode(row, st) for row in finished)
        finished.clear()

    def _module_steps(self, st, module, env, explore, random_actions, device, t, meanwhile) -> list[dict]:
        """The module's outputs for the next env steps, on the host: one step, or with
        `decode_block` k > 1 (`steps_per_round_trip`) k steps computed on the device with each row
        appending the token it took, as the env then does for every row still running (rows that
        finished mid-block ignore the rest: they restart with a prefill).
        `meanwhile()` runs once a block's work is queued, before its outputs are read (they are the
        block's own tensors, not a graph's): on a GPU the host builds episodes while the device
        computes; after a single step's outputs are read."""
        if random_actions or module is None:
            meanwhile()
            return [self._host.to_host(random_step(env))]
        obs = st.obs
        if not st.ever_started.all():  # rows that never started run along on a one-token window
            obs = {**obs, "attention_mask": obs["attention_mask"].copy()}
            obs["attention_mask"][~st.ever_started, -1] = 1
        # ROW_CONTINUES stays on the CPU: the caches branch on it with no device sync
        batch = {Columns.OBS: {k: self._host.to_device(k, v, device) for k, v in obs.items()},
                 ROW_CONTINUES: torch.from_numpy(st.cont.copy())}
        block = steps_per_round_trip(module, self._block, explore)
        if block > 1:
            out = module.act_steps(batch, block, explore)
            meanwhile()
            out = self._host.to_host(out)
            return [{k: v[j] for k, v in out.items()} for j in range(block)]
        out = module.act(batch, t=t) if explore else module.act_greedy(batch)
        out = self._host.to_host({k: v for k, v in out.items() if k != Columns.ACTION_DIST_INPUTS})
        meanwhile()  # after the read: a callback calling the module would overwrite a graph's outputs
        return [out]

    def _episode(self, row, st):
        """A finished row's episode (`Rollout.finish`) as an RLlib episode, built from arrays."""
        obs, actions, rewards, extras = st.episode_arrays(row)
        if self._episode_builder is None or self._episode_builder.extra_keys != tuple(extras):
            self._episode_builder = EpisodeBuilder(self.env.single_observation_space, self.env.single_action_space,
                                                   tuple(extras))
        episode = self._episode_builder.build(obs, [row.reset_info] + [{} for _ in range(row.steps - 1)]
                                              + [row.final_info], actions, rewards, extras)
        make_callback("on_episode_end", callbacks_objects=self._episode_callbacks,
                      callbacks_functions=self.config.callbacks_on_episode_end,
                      kwargs=dict(episode=episode, env_runner=self, metrics_logger=self.metrics,
                                  env=self.env.unwrapped, rl_module=self.module, env_index=row.index,
                                  prev_episode_chunks=[]))
        self._episode_metrics.add(row.steps, float(rewards.sum()), row.seconds)
        return episode


def random_step(env) -> dict:
    """Uniformly random actions for every row (`sample(random_actions=True)`)."""
    B = env.num_envs
    return {Columns.ACTIONS: torch.randint(0, env.vocab_size, (B,)),
            Columns.ACTION_LOGP: torch.full((B,), -math.log(env.vocab_size))}


_Rollout = Rollout  # where checkpoints written before it moved to agents.runner_episodes find it


class StockTokenEnvRunner(_SeededRunnerMixin, SingleAgentEnvRunner):
    """RLlib's runner with per-EnvRunner seeds, and in its state the generators and where its
    sampling stands: the episodes in progress (DQN's n-step fragments end mid-episode), their
    earlier chunks kept for the episode metrics, and the next module input, so a resumed run
    samples on as the uninterrupted one (pinned in tests/test_rllib_contract.py)."""

    def _rollout_state(self) -> dict:
        return {**super()._rollout_state(), **sampling_state(self)}

    def _set_rollout_state(self, state: dict) -> None:
        super()._set_rollout_state(state)
        set_sampling_state(self, state)

    def _try_env_reset(self, *, seed=None, options=None):
        if seed is not None:
            self._seeded_resets = getattr(self, "_seeded_resets", 0)
            seed, self._seeded_resets = seed + self._seeded_resets * SEED_STRIDE, self._seeded_resets + 1
        return super()._try_env_reset(seed=seed, options=options)
