"""Text generation as a Gymnasium MDP, one token per step.

state      prompt tokens + tokens generated so far
action     the next token id, `Discrete(vocab_size)`
transition append the action (deterministic)
end        the EOS action, or `max_new_tokens` generated tokens (both terminal)
reward     the task's reward on the decoded text at the end, 0 before (with `env.dense_reward`:
           each token earns the change of the metric over the text so far)

The observation is `{"input_ids", "attention_mask"}`, int64 arrays of fixed
length `L = max_prompt_len + max_new_tokens`, left-padded so the newest token
is always the last column. `reset(options=...)` restarts from any prompt and
any prefix of generated tokens (guided algorithms roll in from such states).

With `encoder_decoder: true` (a seq2seq policy) the prompt is the encoder's
input and the decoder sees only what was generated: the observation is
`{"input_ids", "attention_mask"}` of length `max_new_tokens` holding the
generated tokens (left-padded, newest last, all padding at the start of an
episode) plus `{"encoder_input_ids", "encoder_attention_mask"}` of length
`max_prompt_len` holding the prompt (right-padded, as encoders are trained).
The policy adds its own decoder start token.
"""
from __future__ import annotations

import json
import math
import os

import gymnasium as gym
import numpy as np

from env.tasks import make_task
from env.tasks.data import BoundedCache, file_stamp
from env.tokenization import load_tokenizer

DEFAULTS = {
    "task": {"name": "increasing_numbers"},
    "tokenizer": None,  # None: the task's own tokenizer
    "max_prompt_len": 5,
    "max_new_tokens": 20,
    "truncation_side": "left",
    "split": "train",
    "dense_reward": False,
    "encoder_decoder": False,
}


def env_setting(env_config: dict, key: str):
    """An env config's value for `key`, or the env's default (DEFAULTS): the one place the
    defaults of settings such as max_prompt_len and max_new_tokens are written."""
    return env_config.get(key, DEFAULTS[key])


class PromptCodec:
    """A tokenizer's encoding of prompt texts and decoding of prompt ids, remembered: a task's
    prompts repeat (one fixed prompt, a data set sampled with replacement), and a reset costs a
    tokenizer call and a decode otherwise. The envs of one set-up share one (`task_setup`).
    Tokenizers are deterministic, so a remembered result is the one a new call would give. At most
    `size` entries each; when full it starts over."""

    def __init__(self, tokenizer, size: int = 4096):
        self.tokenizer, self.size = tokenizer, size
        self._ids: dict[str, tuple[int, ...]] = {}
        self._texts: dict[tuple[int, ...], str] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._ids.get(text)
        if ids is None:
            if len(self._ids) >= self.size:
                self._ids.clear()
            ids = self._ids[text] = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        key = tuple(ids)
        text = self._texts.get(key)
        if text is None:
            if len(self._texts) >= self.size:
                self._texts.clear()
            text = self._texts[key] = self.tokenizer.decode(list(key), skip_special_tokens=True)
        return text


_SETUPS = BoundedCache(16)  # (task section, max_new_tokens, tokenizer, split) -> (task, tokenizer, PromptCodec)


def task_setup(task: dict, max_new_tokens: int, tokenizer: str | None, split: str) -> tuple:
    """(task, tokenizer, prompt codec) for an env config's task section, its max_new_tokens, its
    `tokenizer` and its split (a data task remembers the split it first read, for scoring texts
    whose metadata names none), built once per process and shared by every env built from the
    same four: a generation call makes one env per prompt and a vector env one per row, and
    loading a tokenizer took 29 ms (a 30,522-token WordPiece tokenizer from a local directory) and
    building the numbers task's word-level one 54 ms at 50,255 numbers (2-core machine). A task's
    data and rewards are cached per process already (env/tasks/text_tasks.py); its examples are
    read by each env. A local tokenizer directory's files (name, size, mtime) are part of the key,
    so one rewritten in place is loaded again. The three are shared, not copied: nothing may change
    them (a user's task class is built once per set-up and must keep no per-env state)."""
    key = json.dumps([task, max_new_tokens, tokenizer, split, directory_stamps(tokenizer)], sort_keys=True,
                     default=str)
    if key not in _SETUPS:
        built = make_task(task, max_new_tokens=max_new_tokens)
        tok = built.tokenizer()
        if tok is None:
            if not tokenizer:
                raise ValueError(f"env.tokenizer: task {built.name!r} needs a tokenizer")
            tok = load_tokenizer(tokenizer)
        _SETUPS[key] = (built, tok, PromptCodec(tok))
    return _SETUPS[key]


def directory_stamps(path: str | None) -> tuple:
    """`file_stamp` of each file in a local directory (a tokenizer's); () for anything else."""
    where = os.path.expanduser(path) if path else ""
    if not os.path.isdir(where):
        return ()
    return tuple(file_stamp(os.path.join(where, name)) for name in sorted(os.listdir(where))
                 if os.path.isfile(os.path.join(where, name)))


class TokenGenerationEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, config: dict | None = None, **kwargs):
        cfg = {**DEFAULTS, **dict(config or {}), **kwargs}
        self.max_prompt_len = int(cfg["max_prompt_len"])
        self.max_new_tokens = int(cfg["max_new_tokens"])
        if self.max_prompt_len < 1 or self.max_new_tokens < 1:
            raise ValueError("env: max_prompt_len and max_new_tokens must be >= 1")
        if cfg["truncation_side"] not in ("left", "right"):
            raise ValueError(
                f"env.truncation_side: must be 'left' or 'right', got {cfg['truncation_side']!r}"
            )
        self.truncation_side = cfg["truncation_side"]
        # Dense: each step is rewarded with the change of the task metric over the generation so
        # far (the first step with the metric itself), so an episode's return is still the
        # metric of the finished text; sparse: the metric once, at the end.
        self.dense_reward = bool(cfg["dense_reward"])
        self._metric_so_far = 0.0
        self.task, self.tokenizer, self.prompt_codec = task_setup(cfg["task"], self.max_new_tokens, cfg["tokenizer"],
                                                                     cfg["split"])
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.tokenizer)
        self.encoder_decoder = bool(cfg["encoder_decoder"])
        # The decoder window holds generated tokens only; a causal window holds prompt + generation.
        self.seq_len = self.max_new_tokens if self.encoder_decoder else self.max_prompt_len + self.max_new_tokens
        self.examples = self.task.examples(cfg["split"])
        if not self.examples:
            raise ValueError(f"task {self.task.name!r}: split {cfg['split']!r} has no examples")

        ids_space = gym.spaces.Box(0, self.vocab_size - 1, (self.seq_len,), np.int64)
        mask_space = gym.spaces.Box(0, 1, (self.seq_len,), np.int64)
        spaces = {"input_ids": ids_space, "attention_mask": mask_space}
        if self.encoder_decoder:
            spaces["encoder_input_ids"] = gym.spaces.Box(0, self.vocab_size - 1, (self.max_prompt_len,), np.int64)
            spaces["encoder_attention_mask"] = gym.spaces.Box(0, 1, (self.max_prompt_len,), np.int64)
        self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = gym.spaces.Discrete(self.vocab_size)

        self._prompt_ids: list[int] = []
        self._generated: list[int] = []
        self._example: dict = {}
        self._score = True
        self._done = True

    # -- MDP -------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Starts an episode.

        options (all optional):
          prompt       text of the prompt (else one is drawn from the task's split)
          prompt_ids   the prompt as token ids (instead of `prompt`)
          prefix_ids   generated tokens to restart from (fewer than max_new_tokens, no EOS)
          meta         task metadata for the reward (references, labels, ...)
          score        False: do not compute the reward (every step's is 0.0), e.g. for a
                       user's prompt whose task reward needs references it was not given
        """
        super().reset(seed=seed)
        options = dict(options or {})
        if "prompt" in options or "prompt_ids" in options:
            example = {"prompt": options.get("prompt"), "meta": options.get("meta", {})}
        else:
            example = self.examples[int(self.np_random.integers(len(self.examples)))]
        if options.get("prompt_ids") is not None:
            prompt_ids = [int(t) for t in options["prompt_ids"]]
        else:
            prompt_ids = self.prompt_codec.encode(example["prompt"])
        truncated = len(prompt_ids) > self.max_prompt_len
        if truncated:
            keep = self.max_prompt_len
            prompt_ids = prompt_ids[-keep:] if self.truncation_side == "left" else prompt_ids[:keep]
        if not prompt_ids:
            raise ValueError("reset: the prompt is empty after tokenization")
        prefix = [int(t) for t in options.get("prefix_ids", [])]
        if len(prefix) >= self.max_new_tokens:
            raise ValueError(
                f"reset: prefix_ids has {len(prefix)} tokens; it must be shorter than "
                f"max_new_tokens={self.max_new_tokens}"
            )
        if self.eos_id in prefix:
            raise ValueError("reset: prefix_ids contains EOS; the episode would already be over")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids + prefix):
            raise ValueError(f"reset: token ids must lie in [0, {self.vocab_size})")

        self._example = example
        self._prompt_ids = list(prompt_ids)
        self._generated = prefix
        self._metric_so_far = 0.0
        self._score = bool(options.get("score", True))
        self._done = False
        prompt_text = self.prompt_codec.decode(self._prompt_ids)
        self._example = {**example, "prompt": prompt_text}
        info = {"prompt": prompt_text, "prompt_truncated": truncated}
        return self._observation(), info

    def step(self, action):
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        token = int(action)
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"step: action {token} outside [0, {self.vocab_size})")
        self._generated.append(token)
        self._done = token == self.eos_id or len(self._generated) >= self.max_new_tokens
        reward, info = 0.0, {}
        scoring = (self._done or self.dense_reward) and self._score
        text = self.generated_text() if scoring or self._done else None
        if scoring:
            metric = self.score([self._example["prompt"]], [text], [self._example.get("meta", {})])[0]
            reward, self._metric_so_far = metric - self._metric_so_far, metric
        if self._done:
            info = {"prompt": self._example["prompt"], "generation": text,
                    "num_generated": len(self._generated)}
        return self._observation(), reward, self._done, False, info

    # -- helpers ---------------------------------------------------------------------

    def score(self, prompts: list[str], generations: list[str], metas: list[dict]) -> list[float]:
        """The task's reward, refusing non-finite values with the text that produced them."""
        rewards = [float(r) for r in self.task.reward(prompts, generations, metas)]
        for r, text in zip(rewards, generations):
            if not math.isfinite(r):
                raise ValueError(f"task {self.task.name!r}: reward is {r} for generation {text!r}")
        return rewards

    def generated_text(self) -> str:
        return self.tokenizer.decode(self._generated, skip_special_tokens=True)

    @property
    def example(self) -> dict:
        """The episode's example: its prompt text and the task metadata for the reward."""
        return self._example

    @property
    def scored(self) -> bool:
        """Whether this episode's text is scored (reset option `score`)."""
        return self._score

    @property
    def generated_ids(self) -> list[int]:
        return list(self._generated)

    @property
    def prompt_ids(self) -> list[int]:
        return list(self._prompt_ids)

    def _observation(self) -> dict:
        ids = self._generated if self.encoder_decoder else self._prompt_ids + self._generated
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        mask = np.zeros(self.seq_len, dtype=np.int64)
        if ids:
            input_ids[self.seq_len - len(ids):] = ids
            mask[self.seq_len - len(ids):] = 1
        obs = {"input_ids": input_ids, "attention_mask": mask}
        if self.encoder_decoder:
            n = len(self._prompt_ids)
            obs["encoder_input_ids"] = np.full(self.max_prompt_len, self.pad_id, dtype=np.int64)
            obs["encoder_input_ids"][:n] = self._prompt_ids
            obs["encoder_attention_mask"] = (np.arange(self.max_prompt_len) < n).astype(np.int64)
        return obs


class RepeatedPromptEnv(TokenGenerationEnv):
    """The token env, drawing each prompt for `repeat_prompt` consecutive episodes, and
    reporting the prompt's task metadata in the reset info (for the learner's rewards)."""

    def __init__(self, config: dict | None = None, **kwargs):
        cfg = {**dict(config or {}), **kwargs}
        self.repeat = int(cfg.pop("repeat_prompt", 1))
        super().__init__(cfg)
        self._left, self._current = 0, None

    def reset(self, *, seed=None, options=None):
        if options:  # an explicit restart: as asked
            return super().reset(seed=seed, options=options)
        if seed is not None:  # seeds np_random for the next draws; the current group goes on
            super().reset(seed=seed)
        # RLlib resets with a seed at every sample() call of whole episodes, and one call gives
        # each vector-env row about one episode: a group must go on across calls, or every prompt
        # would appear once per batch and its baseline would be its own return (advantage 0).
        # A group cut by the end of a train batch is averaged over the part in each batch.
        if self._left == 0:
            self._current = self.examples[int(self.np_random.integers(len(self.examples)))]
            self._left = self.repeat
        self._left -= 1
        meta = self._current.get("meta", {})
        obs, info = super().reset(options={"prompt": self._current["prompt"], "meta": meta})
        return obs, {**info, "meta": meta}
