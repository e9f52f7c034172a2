"""The EnvRunner draws new prompts on every sample() of whole episodes, reproducibly per seed."""
from agents.config import algorithm_config, validate
from agents.env_runner import TokenEnvRunner


def first_prompts(runner, calls=2):
    out = []
    for _ in range(calls):
        episodes = runner.sample()  # complete_episodes: one whole episode per vector-env row
        out.append(sorted(tuple(e.get_observations(0)["encoder_input_ids"].tolist()) for e in episodes))
    return out


def test_each_sample_call_draws_new_prompts_and_a_seed_repeats_them():
    cfg = validate({"task": {"name": "sort_numbers"}, "model": {"name_or_path": "tiny-t5"},
                    "env": {"max_prompt_len": 5, "max_new_tokens": 3},
                    "training": {"train_batch_size": 64, "minibatch_size": 32},
                    "env_runners": {"num_envs_per_env_runner": 4}})
    config = algorithm_config(cfg)
    assert config.env_runner_cls is TokenEnvRunner
    runner = TokenEnvRunner(config=config)
    first, second = first_prompts(runner)
    # RLlib reseeds the vector env with the same seed before every such call; without the
    # shifted seed both calls would hold the same four prompts.
    assert len(set(first) & set(second)) == 0
    again = first_prompts(TokenEnvRunner(config=config))
    assert again == [first, second]  # same seed, same prompts
    runner.stop()
