"""What a checkpoint carries beyond RLlib's: fp16's loss scaler (a resumed fp16 run goes on at
the scale it had reached instead of restarting at 65536), DQN's replay buffer, the remote
EnvRunners' rollout states and every learner's generators: each makes a resumed run exact."""
import pickle

import pytest

from agents.config import algorithm_config, load
from tests.conftest import QUICKSTART

FP16 = ["training.precision=fp16", "training.train_batch_size=128", "training.minibatch_size=64",
        "env.max_new_tokens=8", "env_runners.num_envs_per_env_runner=8"]


@pytest.mark.slow
def test_fp16_loss_scale_survives_a_checkpoint(ray_local, tmp_path):
    algo = algorithm_config(load(QUICKSTART, FP16)).build_algo()
    try:
        algo.train()
        scaler = algo.learner_group._learner._grad_scalers["default_policy"]
        # as after overflowed steps halved the scale and 3 clean steps since (the growth tracker)
        scaler.load_state_dict({**scaler.state_dict(), "scale": 1024.0, "_growth_tracker": 3})
        saved = scaler.state_dict()
        assert saved["scale"] == 1024.0 and saved["_growth_tracker"] == 3
        algo.save_to_path(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    fresh = algorithm_config(load(QUICKSTART, FP16)).build_algo()
    try:
        fresh_scaler = fresh.learner_group._learner._grad_scalers["default_policy"]
        fresh_scaler.get_scale()  # a scaler that has not stepped has no state yet: 65536 once it has
        assert fresh_scaler.state_dict()["scale"] == 65536.0
        fresh.restore_from_path(str(tmp_path / "ckpt"))
        restored = fresh.learner_group._learner._grad_scalers["default_policy"].state_dict()
        assert restored["scale"] == 1024.0 and restored["_growth_tracker"] == 3
    finally:
        fresh.stop()


DQN = ["training.train_batch_size=64", "dqn.learning_starts=40", "dqn.epsilon_steps=400", "env.max_new_tokens=8",
       "env_runners.num_envs_per_env_runner=4", "evaluation.interval=0", "dqn.target_update_every=100",
       "dqn.steps_per_iteration=100"]


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_buffer", [True, False])
def test_dqn_resumes_exactly_with_its_replay_buffer(ray_local, tmp_path, checkpoint_buffer):
    """Checkpoint after iteration 2; with dqn.checkpoint_buffer the restored run's iterations 3-5
    equal the uninterrupted run's (it replays the same stored episodes with the same draws);
    without it the buffer refills from empty and the curves part."""
    from tests.test_reproducibility import DQN_YAML, resumed, train

    cfg = load(DQN_YAML, [*DQN, f"dqn.checkpoint_buffer={str(checkpoint_buffer).lower()}"])
    uninterrupted = train(cfg, 5, checkpoint_at=2, path=tmp_path / "ckpt")
    assert all("learners/default_policy/qf_loss" in c for c in uninterrupted[2:])  # it learned from replay
    again = resumed(cfg, tmp_path / "ckpt", 3)
    assert (again == uninterrupted[2:]) is checkpoint_buffer


@pytest.mark.slow
def test_ppo_with_two_remote_env_runners_resumes_exactly(ray_local, tmp_path):
    """Checkpoint after iteration 2 of PPO sampling on 2 remote EnvRunners (episodes carried over
    between calls on each): the restored run's iterations 3-5 equal the uninterrupted run's,
    because each remote runner gets back its own rollout state (RLlib saves the local one's only)."""
    from agents.core import REMOTE_RUNNERS
    from tests.test_reproducibility import TINY, resumed, train

    cfg = load(QUICKSTART, [*TINY, "env_runners.num_env_runners=2", "env_runners.num_cpus_per_env_runner=0.5"])
    uninterrupted = train(cfg, 5, checkpoint_at=2, path=tmp_path / "ckpt")
    again = resumed(cfg, tmp_path / "ckpt", 3)
    assert again == uninterrupted[2:]
    with open(tmp_path / "ckpt" / "algorithm_state.pkl", "rb") as f:
        assert sorted(pickle.load(f)[REMOTE_RUNNERS]) == [1, 2]  # each remote runner's own state


@pytest.mark.slow
def test_ppo_with_two_learners_resumes_exactly(ray_local, tmp_path):
    """Checkpoint after iteration 2 of PPO with 2 learners (each shuffles its shard of the batch
    with its own generator): the restored run's iterations 3-4 equal the uninterrupted run's,
    because each learner gets back its own generators (RLlib saves learner 0's state only)."""
    from agents.core import LEARNER_RNGS
    from tests.test_reproducibility import TINY, resumed, train

    cfg = load(QUICKSTART, [*TINY, "learners.num_learners=2", "learners.num_cpus_per_learner=0.25"])
    uninterrupted = train(cfg, 4, checkpoint_at=2, path=tmp_path / "ckpt")
    again = resumed(cfg, tmp_path / "ckpt", 2)
    assert again == uninterrupted[2:]
    with open(tmp_path / "ckpt" / "algorithm_state.pkl", "rb") as f:
        saved = pickle.load(f)[LEARNER_RNGS]
    assert sorted(saved) == [0, 1] and saved[0]["minibatch"] != saved[1]["minibatch"]


@pytest.mark.slow
def test_a3c_with_a_remote_env_runner_resumes_exactly(ray_local, tmp_path):
    """A3C's remote EnvRunner always has a sample in flight, and its saved rollout state comes after
    that sample: the checkpoint holds the batch too (it was lost, and the resumed run sampled anew
    from where the runner stood after it). Restored after iteration 2, iteration 3 (the saved batch
    and the runner's next one) equals the uninterrupted run's. Later iterations equal it on a quiet
    machine (tested so until 2026-11-29), but one CI run under load saw iteration 4 part: how an
    asynchronous batch falls into iterations is not pinned down, so they are not compared here."""
    from agents.algorithms.a3c import IN_FLIGHT
    from tests.test_reproducibility import A2C, ppo_cfg, resumed, train

    cfg = ppo_cfg(*A2C, "env_runners.num_env_runners=1", "env_runners.num_cpus_per_env_runner=0.5")
    uninterrupted = train(cfg, 5, checkpoint_at=2, path=tmp_path / "ckpt")
    with open(tmp_path / "ckpt" / "algorithm_state.pkl", "rb") as f:
        in_flight = pickle.load(f)[IN_FLIGHT]
    assert [runner for runner, _ in in_flight] == [1] and in_flight[0][1][0]  # runner 1's batch of episodes
    again = resumed(cfg, tmp_path / "ckpt", 3)
    assert len(again) == 3 and again[0] == uninterrupted[2]
    # restored where that runner is gone (A2C: no remote runners), its batch is learned all the same
    fewer = algorithm_config(ppo_cfg(*A2C)).build_algo()
    try:
        fewer.restore_from_path(str(tmp_path / "ckpt"))
        fewer.train()
        assert fewer.updates_by_env_runner[1] == 1 and fewer.updates_by_env_runner[None] >= 1
    finally:
        fewer.stop()
