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


def test_a_floor_that_is_not_positive_or_an_algorithm_that_does_not_read_it_is_refused():
    with pytest.raises(ConfigError, match="training.advantage_std_floor"):
        validate({"algorithm": "ppo", "training": {"advantage_std_floor": 0}})
    for algorithm in ("dqn", "reinforce"):
        with pytest.raises(ConfigError, match="advantage_std_floor"):
            validate({"algorithm": algorithm, "training": {"advantage_std_floor": 0.1}})


class _Values:
    """A module whose V(s) is given (what `compute_values` returns: stored or from a value pass)."""

    def __init__(self, values):
        self.values = values

    def unwrapped(self):
        return self

    def compute_values(self, batch):
        return self.values


def test_the_piece_standardizes_the_loss_steps_of_targets_minus_values():
    from ray.rllib.core.columns import Columns
    from ray.rllib.evaluation.postprocessing import Postprocessing

    targets = torch.tensor([1.0, 0.9, 0.8, 0.8, 0.5])
    values = torch.tensor([0.9, 0.9, 0.9, 0.7, 0.0])
    mask = torch.tensor([True, True, True, True, False])  # the last row: an artificial bootstrap row
    batch = {"p": {Postprocessing.VALUE_TARGETS: targets, Postprocessing.ADVANTAGES: torch.zeros(5),
                   Columns.LOSS_MASK: mask},
             "q": {Columns.ACTIONS: torch.zeros(2)}}  # a module without value targets is left alone
    out = FloorAdvantageStd(floor=0.5)(rl_module={"p": _Values(values)}, batch=batch, episodes=[])
    raw = np.array([0.1, 0.0, -0.1, 0.1])
    np.testing.assert_allclose(out["p"][Postprocessing.ADVANTAGES].numpy(), [*((raw - raw.mean()) / 0.5), 0.0],
                               atol=1e-6)
    assert out["q"] == {Columns.ACTIONS: batch["q"][Columns.ACTIONS]}


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

    from ray.rllib.core.columns import Columns
    from ray.rllib.evaluation.postprocessing import Postprocessing

    cfg = load("tune_configs/aggrevated_synthetic.yaml", SMALL + ["training.advantage_std_floor=2.0"])
    algo = algorithm_config(cfg).build_algo()
    try:
        learner = algo.learner_group._learner
        pipeline = learner._learner_connector
        kinds = [type(c) for c in pipeline.connectors]
        assert GuidedAdvantageEstimation in kinds and FloorAdvantageStd not in kinds
        episodes = algo.env_runner.sample(num_episodes=12)
        out = pipeline(rl_module=learner.module, episodes=episodes, batch={}, shared_data={},
                       metrics=None)["default_policy"]
        batch = {k: v.cpu().numpy() for k, v in out.items() if torch.is_tensor(v)}
    finally:
        algo.stop()
    raw = batch[Postprocessing.VALUE_TARGETS] - batch[Columns.VF_PREDS]
    mask = batch[Columns.LOSS_MASK].astype(bool)
    assert 0 < raw[mask].std() < 2.0  # the floor binds
    np.testing.assert_allclose(batch[Postprocessing.ADVANTAGES], standardize(raw, mask, 2.0), atol=1e-5)
