"""Behaviour kept across refactors: every algorithm's same-seed curve at iterations 1-5 equals the
curve recorded in `tests/data/recorded_curves.json`.

The recorded curves are what the code gave when they were recorded (the file names the commit);
a change meant to keep behaviour (moving code, splitting classes) must reproduce what the
EnvRunners sampled exactly (returns, step counts) and the learner's losses within float rounding
(1e-4 relative): another CPU's kernels round differently (an AMD EPYC machine gave the
recording's sampled values exactly and its losses within 2e-5 relative). A change meant to
alter behaviour re-records them and says so in its commit:

    .venv/bin/python -m tests.test_curves_unchanged --record

Every registered algorithm must have a config here, so a new one cannot slip past.
"""
import json
import os
import subprocess
import sys

import pytest

from agents.algorithms import specs
from agents.config import algorithm_config, read_yaml, validate
from tests.conftest import ROOT
from tests.test_reproducibility import curve

RECORDED = os.path.join(ROOT, "tests", "data", "recorded_curves.json")
ITERATIONS = 5
SMALL = ["training.train_batch_size=128", "training.minibatch_size=64", "training.num_epochs=2",
         "env_runners.num_envs_per_env_runner=8", "env.max_new_tokens=8", "env_runners.num_env_runners=0",
         "checkpoint.frequency=0"]
GUIDED = ["guide.callable=agents.guides:noisy_increasing_numbers"]


def _yaml(name: str, *overrides: str, drop_training=(), task=None) -> dict:
    raw = read_yaml(os.path.join(ROOT, "tune_configs", name), list(overrides))
    for key in drop_training:
        raw["training"].pop(key, None)
    if task is not None:
        raw["task"] = task
    return validate(raw)


# One small config per algorithm (and the PPO variants whose machinery differs: NLPO's learned
# mask, the adaptive KL with the MLE term through mirostat, fp16-free learned masking).
CONFIGS = {
    "ppo": lambda: _yaml("quickstart.yaml", *SMALL),
    "ppo_nlpo_kl_mle": lambda: _yaml(
        "quickstart.yaml", *SMALL, "sampler.name=top_p",
        "sampler.p=0.9", "sampler.masking=learned", "sampler.sync_every=2", "reward.kl_coef=0.01",
        "reward.kl_adaptive=true", "reward.kl_target=1.0", "training.mle_coef=0.5", "training.mle_batch_size=4",
        task={"name": "sort_numbers", "num_numbers": 20, "length": 5}),
    "a3c": lambda: _yaml("a3c_synthetic.yaml", *[o for o in SMALL if "minibatch" not in o and "epochs" not in o],
                         drop_training=("minibatch_size", "num_epochs")),
    "dqn": lambda: _yaml("dqn_synthetic.yaml", "training.train_batch_size=64", "dqn.learning_starts=40",
                         "dqn.epsilon_steps=400", "env.max_new_tokens=8", "env_runners.num_envs_per_env_runner=4",
                         "evaluation.interval=0", "dqn.target_update_every=100"),
    "ppo_pp": lambda: _yaml("ppo_pp_synthetic.yaml", *SMALL, *GUIDED),
    "aggrevated": lambda: _yaml("aggrevated_synthetic.yaml", *SMALL, *GUIDED),
    "lols": lambda: _yaml("lols_synthetic.yaml", *SMALL, *GUIDED),
    "dlols": lambda: _yaml("dlols_synthetic.yaml", *SMALL, *GUIDED, "stop.training_iteration=20"),
    "reinforce": lambda: _yaml("reinforce_synthetic.yaml", *SMALL, "training.num_epochs=1"),
    "ppo_seq2seq": lambda: _yaml("seq2seq_sort_numbers.yaml", *SMALL, "model.name_or_path=tiny-t5",
                                 "tune.storage_path=results"),
    "self_critical": lambda: _yaml("self_critical_synthetic.yaml", *SMALL, "training.num_epochs=1"),
}


def run_curves(name: str) -> list:
    algo = algorithm_config(CONFIGS[name]()).build_algo()
    try:
        return [curve(algo.train()) for _ in range(ITERATIONS)]
    finally:
        algo.stop()


def _recorded() -> dict:
    with open(RECORDED) as f:
        return json.load(f)


def test_every_algorithm_has_a_recorded_curve():
    algorithms = {_yaml_algorithm(name) for name in CONFIGS}
    assert set(specs()) <= algorithms, f"no recorded curve for {sorted(set(specs()) - algorithms)}"
    assert set(_recorded()["curves"]) == set(CONFIGS)


def _yaml_algorithm(name: str) -> str:
    return CONFIGS[name]()["algorithm"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_seed_curve_equals_the_recorded_one(ray_local, name):
    expected = _recorded()["curves"][name]
    got = run_curves(name)
    assert all(len(c) >= 3 for c in got), got  # a reward and losses were compared
    assert [c.keys() for c in got] == [c.keys() for c in expected], f"{name}: other metrics"
    sampled = lambda curve: [{k: v for k, v in c.items() if k.startswith("env_runners/")} for c in curve]  # noqa: E731
    assert sampled(got) == sampled(expected), \
        f"{name}: what the EnvRunners sampled at iterations 1-{ITERATIONS} changed"
    assert all(g == pytest.approx(e, rel=1e-4, abs=1e-7) for g, e in zip(got, expected)), \
        f"{name}: the losses at iterations 1-{ITERATIONS} changed: {got} != {expected}"


def record() -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    curves = {name: run_curves(name) for name in CONFIGS}
    os.makedirs(os.path.dirname(RECORDED), exist_ok=True)
    with open(RECORDED, "w") as f:
        json.dump({"commit": commit, "iterations": ITERATIONS, "curves": curves}, f, indent=1)
        f.write("\n")
    print(f"recorded {len(curves)} curves at {commit} in {RECORDED}")


if __name__ == "__main__" and "--record" in sys.argv:
    record()
