"""The token-generation MDP for a batch of rows, as one `gymnasium.vector.VectorEnv`.

Same MDP as `TokenGenerationEnv` (which stays the reference: a test steps both
with the same actions and compares everything they return), but the step is
batched: the windows of all rows are one (B, L) array, the append transition
is one array operation for all rows, and the reward is one batched call over
the rows whose text is scored in that step (the finished ones; every row with
`dense_reward`). Per-row Python runs only per episode: resets (prompt draw,
tokenization, restarts) go through one `TokenGenerationEnv` per row (or the
`row_env_cls` subclass), and decoding runs only for rows that are scored.

Autoreset follows Gymnasium 1.x (`metadata["autoreset_mode"]`), like
`gymnasium.vector.SyncVectorEnv` over the single env:
  NEXT_STEP  a row that finished is reset by the next `step()` (its action ignored,
             reward 0); the default, what RLlib's stock EnvRunner expects
  SAME_STEP  a row that finishes is reset in the same `step()`; its final observation
             and info are in `info["final_obs"]` / `info["final_info"]`
  DISABLED   rows are reset only by `reset(options={"reset_mask": mask})`; a finished
             row stays finished: `step()` leaves it as it is (action ignored, reward 0,
             terminated True, no info), so a caller may step the batch while some rows
             wait for a reset (the fast EnvRunner does)

`reset(options=...)`: `reset_mask` (bool array) resets only those rows; the other
keys are passed to each reset row's `TokenGenerationEnv.reset` (prompt, prompt_ids,
prefix_ids, meta, score), or `row_options` gives a list with one options dict (or
None) per row, for restarts that differ per row.

Infos are Gymnasium's vector format: `info[key]` holds one value per row and
`info["_" + key]` marks the rows that have that key.
"""
from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from env.text_env import TokenGenerationEnv


def add_row_info(infos: dict, row_info: dict, row: int, num_envs: int) -> dict:
    """Gymnasium's vector-info layout: `infos[k][row] = v` and `infos["_" + k][row] = True`."""
    for key, value in row_info.items():
        if isinstance(value, dict):  # nested, as SyncVectorEnv does: a dict of per-row arrays
            infos[key] = add_row_info(infos.get(key, {}), value, row, num_envs)
            infos.setdefault("_" + key, np.zeros(num_envs, dtype=np.bool_))[row] = True
            continue
        if key not in infos:
            if isinstance(value, (bool, np.bool_)):
                infos[key] = np.zeros(num_envs, dtype=np.bool_)
            elif isinstance(value, (int, np.integer)):
                infos[key] = np.zeros(num_envs, dtype=np.int64)
            elif isinstance(value, (float, np.floating)):
                infos[key] = np.zeros(num_envs, dtype=np.float64)
            else:
                infos[key] = np.full(num_envs, None, dtype=object)
            infos["_" + key] = np.zeros(num_envs, dtype=np.bool_)
        infos[key][row] = value
        infos["_" + key][row] = True
    return infos


def row_info(infos: dict, i: int) -> dict:
    """Row i's info dict out of the vector-info layout (nested dicts too)."""
    return {k: row_info(v, i) if isinstance(v, dict) else v[i]
            for k, v in infos.items() if not k.startswith("_") and infos["_" + k][i]}


class TokenGenerationVectorEnv(gym.vector.VectorEnv):
    metadata = {"autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, config: dict | None = None, num_envs: int = 1, *, autoreset_mode=None,
                 row_env_cls=TokenGenerationEnv):
        cfg = dict(config or {})
        num_envs = int(cfg.pop("num_envs", num_envs))
        mode = cfg.pop("autoreset_mode", None)  # from the env config (RLlib passes only that), unless given here
        mode = autoreset_mode or mode or AutoresetMode.NEXT_STEP
        self.autoreset_mode = mode if isinstance(mode, AutoresetMode) else AutoresetMode(mode)
        self.metadata = {**self.metadata, "autoreset_mode": self.autoreset_mode}
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.num_envs = num_envs
        # One reference env per row: it draws and tokenizes that row's prompts (its own seeded
        # generator, as in SyncVectorEnv) and holds the episode's example for the reward.
        self.rows = [row_env_cls(cfg) for _ in range(num_envs)]
        ref = self.rows[0]  # the rows share one task, tokenizer and prompt memo (`text_env.task_setup`)
        self.tokenizer, self.eos_id, self.pad_id = ref.tokenizer, ref.eos_id, ref.pad_id
        self.vocab_size, self.seq_len, self.max_new_tokens = ref.vocab_size, ref.seq_len, ref.max_new_tokens
        self.max_prompt_len, self.encoder_decoder, self.dense_reward = (
            ref.max_prompt_len, ref.encoder_decoder, ref.dense_reward)
        self.single_observation_space = ref.observation_space
        self.single_action_space = ref.action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.spaces.MultiDiscrete(np.full(num_envs, self.vocab_size))

        B, L = num_envs, self.seq_len
        self._ids = np.full((B, L), self.pad_id, dtype=np.int64)
        self._mask = np.zeros((B, L), dtype=np.int64)
        if self.encoder_decoder:
            self._enc_ids = np.full((B, self.max_prompt_len), self.pad_id, dtype=np.int64)
            self._enc_mask = np.zeros((B, self.max_prompt_len), dtype=np.int64)
        self._num_generated = np.zeros(B, dtype=np.int64)
        self._metric_so_far = np.zeros(B, dtype=np.float64)
        self._scored = np.ones(B, dtype=bool)
        self._done = np.ones(B, dtype=bool)  # every row needs a reset before its first step
        self._autoreset = np.zeros(B, dtype=bool)  # NEXT_STEP: rows the next step() resets

    # -- Gymnasium API -------------------------------------------------------------------

    def reset(self, *, seed=None, options: dict | None = None):
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        row_options = options.pop("row_options", None)
        if mask is None:
            mask = np.ones(self.num_envs, dtype=bool)
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != (self.num_envs,):
            raise ValueError(f"reset: reset_mask must have shape ({self.num_envs},), got {mask.shape}")
        if row_options is not None and len(row_options) != self.num_envs:
            raise ValueError(f"reset: row_options must have {self.num_envs} entries, got {len(row_options)}")
        if seed is None:
            seeds = [None] * self.num_envs
        elif isinstance(seed, (int, np.integer)):
            seeds = [int(seed) + i for i in range(self.num_envs)]
        else:
            seeds = list(seed)
        infos: dict = {}
        for i in np.flatnonzero(mask):
            opts = row_options[i] if row_options is not None and row_options[i] is not None else options
            infos = add_row_info(infos, self._reset_row(int(i), seed=seeds[i], options=opts or None), int(i),
                                 self.num_envs)
        return self._observations(), infos

    def step(self, actions):
        actions = np.asarray(actions, dtype=np.int64).reshape(self.num_envs)
        B = self.num_envs
        rewards = np.zeros(B, dtype=np.float64)
        terminated = np.zeros(B, dtype=bool)
        infos: dict = {}
        mode = self.autoreset_mode
        if mode == AutoresetMode.NEXT_STEP:
            resetting = self._autoreset
            live = ~resetting
        elif mode == AutoresetMode.DISABLED:
            resetting = np.zeros(B, dtype=bool)
            live = ~self._done
        else:
            resetting = np.zeros(B, dtype=bool)
            live = ~self._done
            if not live.all():
                raise RuntimeError("step() called with finished rows; call reset() first")
        bad = live & ((actions < 0) | (actions >= self.vocab_size))
        if bad.any():
            raise ValueError(f"step: action {int(actions[bad][0])} outside [0, {self.vocab_size})")

        # The transition for every live row at once: shift the window left, append the action.
        if live.all():
            self._ids[:, :-1] = self._ids[:, 1:]
            self._mask[:, :-1] = self._mask[:, 1:]
            self._ids[:, -1] = actions
            self._mask[:, -1] = 1
        elif live.any():
            rows = np.flatnonzero(live)
            self._ids[rows, :-1] = self._ids[rows, 1:]
            self._mask[rows, :-1] = self._mask[rows, 1:]
            self._ids[rows, -1] = actions[rows]
            self._mask[rows, -1] = 1
        self._num_generated[live] += 1
        finished = live & ((actions == self.eos_id) | (self._num_generated >= self.max_new_tokens))
        terminated[finished] = True
        self._done |= finished

        scoring = (finished | (live & self.dense_reward)) & self._scored
        texts = {}
        if scoring.any() or finished.any():
            for i in np.flatnonzero(scoring | finished):
                texts[int(i)] = self.generated_text(int(i))
        if scoring.any():
            rows = [int(i) for i in np.flatnonzero(scoring)]
            metrics = self.rows[0].score([self.rows[i].example["prompt"] for i in rows], [texts[i] for i in rows],
                                         [self.rows[i].example.get("meta", {}) for i in rows])
            for i, metric in zip(rows, metrics):
                rewards[i] = metric - self._metric_so_far[i]
                self._metric_so_far[i] = metric
        for i in np.flatnonzero(finished):
            i = int(i)
            infos = add_row_info(infos, {"prompt": self.rows[i].example["prompt"], "generation": texts[i],
                                         "num_generated": int(self._num_generated[i])}, i, B)

        if mode == AutoresetMode.SAME_STEP and finished.any():
            final_obs = self._observations()
            final_infos, infos = infos, {}
            for i in np.flatnonzero(finished):
                i = int(i)
                row_final = row_info(final_infos, i)
                infos = add_row_info(infos, {"final_obs": {k: v[i] for k, v in final_obs.items()},
                                             "final_info": row_final}, i, B)
                infos = add_row_info(infos, self._reset_row(i), i, B)
        for i in np.flatnonzero(resetting):
            infos = add_row_info(infos, self._reset_row(int(i)), int(i), B)
        if mode == AutoresetMode.NEXT_STEP:
            self._autoreset = finished
        elif mode == AutoresetMode.DISABLED:  # rows waiting for a reset stay terminated
            terminated = self._done.copy()
        return self._observations(), rewards, terminated, np.zeros(B, dtype=bool), infos

    # -- helpers -------------------------------------------------------------------------

    def _reset_row(self, i: int, *, seed=None, options=None) -> dict:
        row = self.rows[i]
        obs, info = row.reset(seed=seed, options=options)
        self._ids[i], self._mask[i] = obs["input_ids"], obs["attention_mask"]
        if self.encoder_decoder:
            self._enc_ids[i], self._enc_mask[i] = obs["encoder_input_ids"], obs["encoder_attention_mask"]
        self._num_generated[i] = len(row.generated_ids)
        self._metric_so_far[i] = 0.0
        self._scored[i] = row.scored
        self._done[i] = False
        self._autoreset[i] = False
        return info

    def _observations(self) -> dict:
        obs = {"input_ids": self._ids.copy(), "attention_mask": self._mask.copy()}
        if self.encoder_decoder:
            obs["encoder_input_ids"] = self._enc_ids.copy()
            obs["encoder_attention_mask"] = self._enc_mask.copy()
        return obs

    def generated_ids(self, i: int) -> list[int]:
        """Row i's generated tokens (restart prefix included): the newest columns of its window."""
        n = int(self._num_generated[i])
        return self._ids[i, self.seq_len - n:].tolist() if n else []

    def generated_text(self, i: int) -> str:
        return self.tokenizer.decode(self.generated_ids(i), skip_special_tokens=True)

    @property
    def done(self) -> np.ndarray:
        """Which rows have finished their episode (and wait for a reset)."""
        return self._done.copy()
