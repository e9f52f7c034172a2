import os
import time

import numpy as np
import pytest

import env  # noqa: F401  (registers the env id)
import gymnasium as gym
from env.rewards import increasing_pairs_reward
from env.text_env import TokenGenerationEnv


def make(**kw):
    cfg = {"task": {"name": "increasing_numbers", "num_numbers": 10}, "max_prompt_len": 4, "max_new_tokens": 5}
    cfg.update(kw)
    return TokenGenerationEnv(cfg)


def real_tokens(obs):
    return obs["input_ids"][obs["attention_mask"] == 1].tolist()


def num(e, n):
    return e.tokenizer.convert_tokens_to_ids(str(n))


def test_spaces_and_registered_name():
    e = gym.make("TokenGeneration-v0", task={"name": "increasing_numbers", "num_numbers": 10},
                 max_prompt_len=4, max_new_tokens=5).unwrapped
    assert e.action_space.n == 12  # pad, eos, "0".."9"
    for key in ("input_ids", "attention_mask"):
        space = e.observation_space[key]
        assert space.shape == (9,) and space.dtype == np.int64


def test_step_appends_the_action_and_left_pads():
    e = make()
    obs, info = e.reset(seed=0, options={"prompt": "3 4"})
    assert real_tokens(obs) == [num(e, 3), num(e, 4)]
    assert obs["attention_mask"].tolist() == [0] * 7 + [1] * 2
    assert obs["input_ids"][:7].tolist() == [e.pad_id] * 7
    obs2, reward, terminated, truncated, _ = e.step(num(e, 7))
    assert real_tokens(obs2) == [num(e, 3), num(e, 4), num(e, 7)]
    assert obs2["input_ids"][-1] == num(e, 7)  # newest token in the last column
    assert reward == 0.0 and not terminated and not truncated


def test_horizon_terminates_with_task_reward():
    e = make()
    e.reset(seed=0)
    for k, n in enumerate([1, 2, 3, 2, 5]):
        obs, reward, terminated, truncated, info = e.step(num(e, n))
        if k < 4:
            assert not terminated and reward == 0.0
    assert terminated and not truncated
    assert info["generation"] == "1 2 3 2 5"
    assert reward == pytest.approx(3 / 4)
    assert obs["attention_mask"].sum() == 5 + 4  # prompt of 4 pads + 5 tokens, no room wasted
    with pytest.raises(RuntimeError):
        e.step(num(e, 1))


def test_dense_reward_pays_each_tokens_change_of_the_metric_and_sums_to_the_sparse_return():
    e = make(dense_reward=True)
    e.reset(seed=0)
    rewards = [e.step(num(e, n))[1] for n in [1, 2, 3, 2, 5]]
    assert rewards == pytest.approx([0.0, 1 / 4, 1 / 4, 0.0, 1 / 4])
    assert sum(rewards) == pytest.approx(3 / 4)  # the sparse env's one reward for the same text
    e.reset(seed=0, options={"prefix_ids": [num(e, 1), num(e, 4)]})  # restart: the prefix's pair counts once
    rewards = [e.step(num(e, 7))[1], e.step(e.eos_id)[1]]
    assert rewards == pytest.approx([2 / 4, 0.0])


def test_eos_terminates_early_and_cannot_game_the_reward():
    e = make()
    e.reset(seed=0)
    e.step(num(e, 1))
    e.step(num(e, 2))
    _, reward, terminated, _, info = e.step(e.eos_id)
    assert terminated
    assert info["generation"] == "1 2" and info["num_generated"] == 3
    assert reward == pytest.approx(1 / 4)  # one ascending pair out of max_new_tokens - 1


def test_reset_to_prompt_and_prefix():
    e = make()
    obs, _ = e.reset(options={"prompt": "9", "prefix_ids": [num(e, 1), num(e, 2)]})
    assert real_tokens(obs) == [num(e, 9), num(e, 1), num(e, 2)]
    assert e.generated_ids == [num(e, 1), num(e, 2)]
    # Three more tokens reach the horizon of 5 generated tokens.
    for n in (3, 4):
        assert not e.step(num(e, n))[2]
    _, reward, terminated, _, info = e.step(num(e, 5))
    assert terminated and info["generation"] == "1 2 3 4 5" and reward == 1.0
    # Restart from token ids directly.
    obs, _ = e.reset(options={"prompt_ids": [num(e, 0)], "prefix_ids": []})
    assert real_tokens(obs) == [num(e, 0)]


def test_reset_rejects_impossible_states():
    e = make()
    with pytest.raises(ValueError, match="shorter than max_new_tokens"):
        e.reset(options={"prefix_ids": [num(e, 1)] * 5})
    with pytest.raises(ValueError, match="EOS"):
        e.reset(options={"prefix_ids": [e.eos_id]})
    with pytest.raises(ValueError, match="token ids"):
        e.reset(options={"prompt_ids": [999]})


@pytest.mark.parametrize("side,expected", [("left", [6, 7, 8, 9]), ("right", [4, 5, 6, 7])])
def test_long_prompts_are_truncated_on_the_configured_side(side, expected):
    e = make(truncation_side=side)
    obs, info = e.reset(options={"prompt": "4 5 6 7 8 9"})
    assert real_tokens(obs) == [num(e, n) for n in expected]
    assert info["prompt_truncated"] is True
    assert info["prompt"] == " ".join(str(n) for n in expected)


def test_synthetic_prompt_is_pad_tokens():
    e = TokenGenerationEnv()  # defaults: 5 pad tokens, 20 new tokens
    obs, _ = e.reset(seed=1)
    assert real_tokens(obs) == [e.pad_id] * 5
    assert obs["input_ids"].shape == (25,)


def test_increasing_pairs_reward_on_hand_made_sequences():
    gens = ["0 1 2 3 4", "4 3 2 1 0", "1 1 1 1 1", "0 5 1 6 2", "1 2", ""]
    assert increasing_pairs_reward([""] * 6, gens, None, length=5) == [1.0, 0.0, 0.0, 0.5, 0.25, 0.0]


def test_non_finite_reward_is_reported_with_the_text(monkeypatch):
    e = make()
    monkeypatch.setattr(e.task, "reward", lambda prompts, gens, metas: [float("nan")])  # envs share the task
    e.reset(seed=0)
    for _ in range(4):
        e.step(num(e, 1))
    with pytest.raises(ValueError, match=r"reward is nan for generation '1 1 1 1 1'"):
        e.step(num(e, 1))


def test_random_policy_baseline():
    e = TokenGenerationEnv()
    rng = np.random.default_rng(0)
    returns = []
    for i in range(300):
        e.reset(seed=i)
        done = False
        while not done:
            _, r, done, _, _ = e.step(int(rng.integers(e.vocab_size)))
        returns.append(r)
    # Uniform over 52 actions: EOS (1/52 per step) and pad tokens shorten sequences.
    assert 0.3 < np.mean(returns) < 0.45


def test_envs_of_one_setup_share_the_task_and_tokenizer_and_a_rewritten_tokenizer_is_loaded_again(tmp_path):
    """A generation call builds one env per prompt and a vector env one per row: the task, its
    tokenizer and the prompt memo are built once per process for a config (`task_setup`); each
    env still draws its own prompts. A local tokenizer directory written again is read again."""
    from env.tokenization import word_level_tokenizer

    cfg = {"task": {"name": "increasing_numbers", "num_numbers": 30}, "max_new_tokens": 6}
    a, b = TokenGenerationEnv(cfg), TokenGenerationEnv(dict(cfg))
    assert a.task is b.task and a.tokenizer is b.tokenizer and a.prompt_codec is b.prompt_codec
    other = TokenGenerationEnv({**cfg, "max_new_tokens": 7})  # the task takes max_new_tokens
    assert other.task is not a.task
    a.reset(seed=0)
    b.reset(seed=0)
    a.step(5)
    assert b.generated_ids == [] and a.generated_ids == [5]  # per-episode state is each env's own

    words = tmp_path / "tok"
    word_level_tokenizer(["x", "y"]).save_pretrained(str(words))
    text = {"task": {"name": "text", "dataset": str(_prompts(tmp_path)), "reward": {"name": "bleu"},
                     "reference_field": "ref"}, "tokenizer": str(words),
            "max_prompt_len": 4, "max_new_tokens": 4}
    first = TokenGenerationEnv(text)
    assert TokenGenerationEnv(text).tokenizer is first.tokenizer and first.vocab_size == 4
    word_level_tokenizer(["x", "y", "z"]).save_pretrained(str(words))
    for f in words.iterdir():  # a new mtime even on a coarse file clock
        os.utime(f, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    assert TokenGenerationEnv(text).vocab_size == 5


def _prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "x y", "ref": "x"}\n{"prompt": "y x", "ref": "y"}\n')
    return path
