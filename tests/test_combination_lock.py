"""The combination_lock task: its reward, its errors, how rarely random exploration opens it,
the scripted guide, and PPO++ learning to open it where plain PPO does not."""
import random

import numpy as np
import pytest

from agents.guides import combination_lock
from env.rewards.ordering import contains_pattern_reward
from env.tasks import make_task
from env.tasks.combination_lock import DEFAULT_PATTERN
from env.text_env import TokenGenerationEnv

PATTERN = tuple(int(w) for w in DEFAULT_PATTERN.split())


def lock_env(**kw):
    return TokenGenerationEnv({"task": {"name": "combination_lock"}, "max_prompt_len": 5, "max_new_tokens": 20, **kw})


def test_reward_is_one_only_for_the_contiguous_pattern():
    texts = ["7 31 18", "1 2 7 31 18 4", "7 31 9 18", "7 31", "1 2 3 4 5 6 7 31 18", "18 31 7", "7 7 31 18",
             "7 31 <eos> 18", ""]
    # A non-number token between numbers is skipped, as in the increasing-numbers reward.
    assert contains_pattern_reward([""] * len(texts), texts, pattern=PATTERN) == [1, 1, 0, 0, 1, 0, 1, 1, 0]


@pytest.mark.parametrize("options,field", [
    ({"pattern": ""}, "task.pattern: give the numbers"),
    ({"pattern": "7 x 18"}, "task.pattern: '7 x 18' is not space-separated numbers"),
    ({"pattern": "7 50"}, "task.pattern: 50 is not among the task's numbers 0..49"),
    ({"pattern": " ".join(["1"] * 21)}, "task.pattern: 21 numbers do not fit in env.max_new_tokens=20"),
])
def test_bad_patterns_are_refused_naming_the_field(options, field):
    with pytest.raises(ValueError) as e:
        make_task({"name": "combination_lock", **options}, max_new_tokens=20)
    assert str(e.value).startswith(field)


def test_random_exploration_almost_never_opens_the_lock():
    task = make_task({"name": "combination_lock"}, max_new_tokens=20)
    rng = np.random.default_rng(0)
    texts = [" ".join(map(str, row)) for row in rng.integers(0, 50, size=(20_000, 20))]
    rate = float(np.mean(task.reward([""] * len(texts), texts, [{}] * len(texts))))
    assert rate < 1e-3  # expected (20 - 3 + 1) / 50**3 = 1.4e-4


def test_guide_continues_a_partial_pattern_and_opens_the_lock():
    random.seed(0)
    assert combination_lock(["<pad> <pad>", "3 7", "3 7 31", "7 31 18 2"], noise=0.0)[:3] == ["7", "31", "18"]
    env = lock_env(dense_reward=True)
    opened = 0
    for episode in range(200):
        env.reset(seed=episode)
        total, done = 0.0, False
        while not done:
            prefix = env.tokenizer.decode(env._generated, skip_special_tokens=True)
            token = env.tokenizer.convert_tokens_to_ids(combination_lock([prefix])[0])
            _, reward, done, _, info = env.step(token)
            total += reward
        final = contains_pattern_reward([""], [info["generation"]], pattern=PATTERN)[0]
        assert total == pytest.approx(final)  # the dense rewards sum to the terminal one
        opened += final
    assert opened / 200 >= 0.9


def test_dense_reward_pays_at_the_token_that_completes_the_pattern():
    env = lock_env(dense_reward=True)
    env.reset(seed=0)
    ids = [env.tokenizer.convert_tokens_to_ids(str(n)) for n in (1, 7, 31, 18, 7, 31, 18, 2)]
    assert [env.step(t)[1] for t in ids] == [0, 0, 0, 1, 0, 0, 0, 0]


@pytest.mark.slow
def test_ppo_pp_on_the_lock_sees_rewards_only_through_the_guide(ray_local):
    """PPO++ on tune_configs/ppo_pp_lock.yaml: episodes with a guide roll-in open the lock (the
    guide shows where the reward is); the policy's own episodes do not, at first."""
    from agents.config import algorithm_config, load

    cfg = load("tune_configs/ppo_pp_lock.yaml", ["training.train_batch_size=1024", "training.minibatch_size=256",
                                                 "guide.beta=0.5"])
    algo = algorithm_config(cfg).build_algo()
    try:
        runners = [algo.train()["env_runners"] for _ in range(2)][-1]
    finally:
        algo.stop()
    assert runners["episode_return_mean"] > 0.2  # about beta x P(roll-in of 3+ tokens) = 0.5 x 3/5
    assert runners["policy_return_mean"] < 0.05
