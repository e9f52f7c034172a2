"""`training.advantage_std_floor`: the PPO family's advantages standardized with a floor under the
divisor (agents/algorithms/advantages.py)."""
import copy

import numpy as np
import pytest
import torch

from agents.algorithms.advantages import FloorAdvantageStd, standardize
from agents.config import ConfigError, algorithm_config, load, read_yaml, validate
from tests.conftest import QUICKSTART

SMALL = ["training.train_batch_size=256", "training.minibatch_size=128", "env_runners.num_envs_per_env_runner=8"]


def test_standardize_divides_by_the_floor_where_the_std_is_below_it():
    adv = np.array([0.010, 0.012, 0.008, 0.010, 9.0], dtype=np.float32)
    mask = np.array([True, True, True, True, False])
    live = adv[:4]
    np.testing.assert_allclose(standardize(adv, mask)[:4], (live - live.mean()) / live.std(), rtol=1e-5)
    np.testing.assert_allclose(standardize(adv, mask, 0.5)[:4], (live - live.mean()) / 0.5, rtol=1e-5)
    assert standardize(adv, mask, 0.5)[4] == 0.0
    big = np.array([1.0, -1.0, 3.0, -3.0], dtype=np.float32)  # std above the floor: the floor changes nothing
    np.testing.assert_allclose(standardize(big, np.ones(4, bool), 0.5), standardize(big, np.ones(4, bool)))


def test_a_floor_that_is_not_positive_or_an_algorithm_without_advantages_is_refused():
    with pytest.raises(ConfigError, match="training.advantage_std_floor"):
        validate({"algorithm": "ppo", "training": {"advantage_std_floor": 0}})
    with pytest.raises(ConfigError, match="advantage_std_floor"):
        validate({"algorithm": "dqn", "training": {"advantage_std_floor": 0.1}})


@pytest.mark.parametrize("algorithm", ["ppo", "a3c"])
def test_the_learner_batch_takes_the_floor_and_the_default_is_rllibs_pipeline(ray_local, algorithm):
    """With a floor, the learner's advantages are (R - V - mean) / max(floor, std) of the values the
    rollout stored; at the default the pipeline has no extra piece and its advantages have unit std."""
    from ray.rllib.core.columns import Columns
    from ray.rllib.evaluation.postprocessing import Postprocessing

    results = {}
    for floor in (None, 2.0):
        overrides = SMALL + ([f"training.advantage_std_floor={floor}"] if floor else [])
        if algorithm == "ppo":
            cfg = load(QUICKSTART, overrides)
        else:  # the quickstart as A2C: its PPO-only keys removed
            raw = read_yaml(QUICKSTART, overrides + ["algorithm=a3c"])
            for key in ("minibatch_size", "num_epochs"):
                raw["training"].pop(key)
            cfg = validate(raw)
        algo = algorithm_config(cfg).build_algo()
        try:
            learner = algo.learner_group._learner
            pipeline = learner._learner_connector
            assert any(type(c) is FloorAdvantageStd for c in pipeline.connectors) == (floor is not None)
            episodes = algo.env_runner.sample(num_episodes=12)
            out = pipeline(rl_module=learner.module, episodes=copy.deepcopy(episodes), batch={}, shared_data={},
                           metrics=None)["default_policy"]
            results[floor] = {k: v.cpu().numpy() for k, v in out.items() if torch.is_tensor(v)}
        finally:
            algo.stop()
    for floor, batch in results.items():
        raw = batch[Postprocessing.VALUE_TARGETS] - batch[Columns.VF_PREDS]
        assert raw.std() < 2.0  # the floor binds: advantages centred, divided by 2
        divisor = raw.std() if floor is None else floor
        np.testing.assert_allclose(batch[Postprocessing.ADVANTAGES], (raw - raw.mean()) / divisor, atol=1e-5)


def test_guided_advantages_take_the_floor_in_place_of_the_extra_piece(ray_local):
    from agents.algorithms.guided_advantages import GuidedAdvantageEstimation

    cfg = load("tune_configs/aggrevated_synthetic.yaml", SMALL + ["training.advantage_std_floor=0.5"])
    algo = algorithm_config(cfg).build_algo()
    try:
        kinds = [type(c) for c in algo.learner_group._learner._learner_connector.connectors]
        assert FloorAdvantageStd not in kinds
        (guided,) = [c for c in algo.learner_group._learner._learner_connector.connectors
                     if type(c) is GuidedAdvantageEstimation]
        assert guided.floor == 0.5
    finally:
        algo.stop()
