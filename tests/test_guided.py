"""Guided RL (PPO++, AggreVaTeD, LOLS, DLOLS): roll-ins, loss masks, advantages, mode switching, bad guides."""
import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing

from agents.algorithms.advantages import standardize
from agents.algorithms.guided import guide_mode
from agents.algorithms.guided_advantages import guided_loss_mask, guided_value_targets
from agents.config import ConfigError, validate
from agents.guides import (DEVIATION, GUIDE, GUIDE_ROLE, POLICY, CallableGuide, GuideError, GuidedRollout,
                           LMGuide, check_guide_vocabulary)
from agents.modules import CausalLMActorCritic
from env.text_env import TokenGenerationEnv
from env.tokenization import word_level_tokenizer

ENV_CFG = {"task": {"name": "increasing_numbers", "num_numbers": 30}, "max_prompt_len": 5, "max_new_tokens": 8}
GUIDE_SPEC = "tests.test_guided:count_up_guide"


def count_up_guide(prefixes):
    """Deterministic scripted guide: the next number is 10 + the count of numbers so far."""
    return [str(10 + len(p.split())) for p in prefixes]


def whole_continuation_guide(prefixes):
    whole_continuation_guide.calls = getattr(whole_continuation_guide, "calls", 0) + 1
    return ["3 4 5 6" for _ in prefixes]


def wrong_length_guide(prefixes):
    return ["1"]


def non_text_guide(prefixes):
    return [3.5 for _ in prefixes]


def guided_module(mode="ppo_pp", **guide):
    env = TokenGenerationEnv(ENV_CFG)
    module = CausalLMActorCritic(
        observation_space=env.observation_space, action_space=env.action_space, inference_only=True,
        model_config={"model": {"name_or_path": "tiny-gpt2"}, "env": ENV_CFG, "seed": 0,
                      "guide": {"callable": GUIDE_SPEC, "mode": mode, "beta": 0.2, "mix": 0.8, **guide}})
    return env, module


def run_episodes(envs, module, n_steps):
    """Steps a list of envs together through the module's exploration forward; per env, the
    list of (observation, action, role) of its first episode."""
    obs = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
    traces = [[] for _ in envs]
    done = [False] * len(envs)
    for _ in range(n_steps):
        batch = {k: torch.as_tensor(np.stack([o[k] for o in obs])) for k in obs[0]}
        out = module.forward_exploration({Columns.OBS: batch})
        for i, env in enumerate(envs):
            if done[i]:
                continue
            a, role = int(out[Columns.ACTIONS][i]), int(out[GUIDE_ROLE][i])
            traces[i].append((obs[i], a, role))
            obs[i], _, done[i], _, _ = env.step(a)
        if all(done):
            break
    return traces


def test_ppo_pp_rollin_hands_the_policy_exactly_the_guides_state():
    envs = [TokenGenerationEnv(ENV_CFG) for _ in range(6)]
    _, module = guided_module("ppo_pp", beta=1.0)  # every episode rolls in with the guide
    traces = run_episodes(envs, module, ENV_CFG["max_new_tokens"])
    for trace in traces:
        roles = [r for _, _, r in trace]
        k = roles.index(POLICY)
        assert 1 <= k <= ENV_CFG["max_new_tokens"] - 1
        assert roles[:k] == [GUIDE] * k and set(roles[k:]) == {POLICY}  # guide first, then the policy only
        guide_tokens = [a for _, a, _ in trace[:k]]
        tok = envs[0].tokenizer
        assert tok.decode(guide_tokens) == " ".join(str(10 + i) for i in range(k))  # the guide's own tokens
        # The policy's first state is the state a restart to the guide's prefix gives.
        restart = TokenGenerationEnv(ENV_CFG)
        expected, _ = restart.reset(options={"prompt_ids": envs[0].prompt_ids, "prefix_ids": guide_tokens})
        for key in expected:
            np.testing.assert_array_equal(trace[k][0][key], expected[key])


def test_unguided_episodes_and_mode_none_are_the_policy_alone():
    envs = [TokenGenerationEnv(ENV_CFG) for _ in range(4)]
    _, module = guided_module("ppo_pp", beta=0.0)
    assert all(r == POLICY for t in run_episodes(envs, module, 8) for _, _, r in t)
    _, module = guided_module("ppo_pp", beta=1.0)  # every episode would roll in with the guide...
    module.set_guide_mode("none")  # ...but mode none (the policy-alone evaluation) takes no guide step
    traces = run_episodes(envs, module, 8)
    assert sum(len(t) for t in traces) >= 4 and all(r == POLICY for t in traces for _, _, r in t)


def test_aggrevated_has_one_policy_step_then_the_guide_completes():
    envs = [TokenGenerationEnv(ENV_CFG) for _ in range(8)]
    _, module = guided_module("aggrevated", mix=1.0)  # pure guide roll-in: every other token is the guide's
    traces = run_episodes(envs, module, ENV_CFG["max_new_tokens"])
    # a trace whose text ended before its sampled step has none; most have one
    assert sum(DEVIATION in [r for _, _, r in t] for t in traces) >= 6, traces
    for trace in traces:
        roles = [r for _, _, r in trace]
        assert roles.count(DEVIATION) <= 1
        if DEVIATION not in roles:
            continue
        d = roles.index(DEVIATION)
        assert all(r == GUIDE for i, r in enumerate(roles) if i != d)
        tok = envs[0].tokenizer
        tokens = [a for _, a, _ in trace]
        for i, a in enumerate(tokens):
            if i != d:  # every other token is the guide's answer for the text so far
                assert tok.decode([a]) == str(10 + len(tok.decode(tokens[:i], skip_special_tokens=True).split()))


def test_guide_steps_are_not_loss_steps_and_pay_no_advantage():
    loss_mask = torch.tensor([True, True, True, True, False])  # the last row: RLlib's bootstrap step
    roles = torch.tensor([GUIDE, GUIDE, POLICY, POLICY, POLICY])
    mask = guided_loss_mask(loss_mask, roles)
    assert mask.tolist() == [False, False, True, True, False]
    adv = standardize(np.array([5.0, -5.0, 1.0, 3.0, 7.0], dtype=np.float32), mask.numpy())
    assert adv[~mask.numpy()].tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_allclose(adv[mask.numpy()], [-1.0, 1.0], atol=1e-5)  # standardised over loss steps only


def test_aggrevated_advantage_is_the_guide_completed_reward_minus_the_baseline():
    # One AggreVaTeD episode of 4 tokens: roll-in, the policy's step (d = 1), guide roll-out;
    # the completed text earns 0.75 at the end; then RLlib's artificial bootstrap row.
    rewards = np.array([0.0, 0.0, 0.0, 0.75, 0.0], dtype=np.float32)
    values = np.array([0.1, 0.3, 0.5, 0.2, 0.9], dtype=np.float32)
    terminateds = np.array([0, 0, 0, 1, 0], dtype=np.float32)
    truncateds = np.zeros(5, dtype=np.float32)
    roles = np.array([GUIDE, DEVIATION, GUIDE, GUIDE, GUIDE])
    targets, adv = guided_value_targets(values, rewards, terminateds, truncateds, roles, gamma=1.0, lambda_=0.5)
    assert adv[1] == pytest.approx(0.75 - 0.3)
    assert targets[1] == pytest.approx(0.75)
    # A PPO step with lambda 0.5 gets GAE instead (here differs from the Monte-Carlo return).
    _, adv_ppo = guided_value_targets(values, rewards, terminateds, truncateds, np.full(5, POLICY), gamma=1.0,
                                      lambda_=0.5)
    d1, d2, d3 = 0.0 + 0.5 - 0.3, 0.0 + 0.2 - 0.5, 0.75 - 0.2
    assert adv_ppo[1] == pytest.approx(d1 + 0.5 * (d2 + 0.5 * d3))


def test_dlols_switches_at_the_configured_iteration_and_lols_mixes_per_iteration():
    dlols = {"algorithm": "dlols", "switch_iteration": 3}
    assert [guide_mode(dlols, i) for i in range(6)] == ["aggrevated"] * 3 + ["ppo_pp"] * 3
    cfg = validate({"algorithm": "dlols", "guide": {"callable": GUIDE_SPEC, "switch_fraction": 0.25},
                    "stop": {"training_iteration": 40}})
    from agents.algorithms.guided import dlols_switch_iteration
    assert dlols_switch_iteration(cfg) == 10
    lols = {"algorithm": "lols", "lols_prob": 0.3, "seed": 0}
    modes = [guide_mode(lols, i) for i in range(2000)]
    assert modes == [guide_mode(lols, i) for i in range(2000)]  # the same on resume
    assert 0.25 < modes.count("aggrevated") / len(modes) < 0.35
    assert guide_mode({"algorithm": "ppo"}, 5) == "none"


def test_callable_guide_keeps_a_continuation_while_the_row_follows_it():
    tok = TokenGenerationEnv(ENV_CFG).tokenizer
    guide = CallableGuide("tests.test_guided:whole_continuation_guide", tok)
    env = TokenGenerationEnv(ENV_CFG)
    obs, _ = env.reset(seed=0)
    whole_continuation_guide.calls = 0
    tokens = []
    for _ in range(4):
        batch = {k: torch.as_tensor(v)[None] for k, v in obs.items()}
        a = int(guide.next_tokens(batch, torch.tensor([0]))[0])
        tokens.append(a)
        obs, *_ = env.step(a)
    assert tok.decode(tokens) == "3 4 5 6" and whole_continuation_guide.calls == 1


@pytest.mark.parametrize("fn, message", [
    ("wrong_length_guide", r"guide\.callable: tests\.test_guided:wrong_length_guide must return a list with one "
                           r"continuation per prefix \(2\)"),
    ("non_text_guide", r"guide\.callable: .* returned 3\.5 .*expected a string or a non-empty list of token ids"),
])
def test_malformed_callable_output_is_one_clear_error(fn, message):
    tok = TokenGenerationEnv(ENV_CFG).tokenizer
    guide = CallableGuide(f"tests.test_guided:{fn}", tok)
    env = TokenGenerationEnv(ENV_CFG)
    obs, _ = env.reset(seed=0)
    batch = {k: torch.as_tensor(np.stack([v, v])) for k, v in obs.items()}
    with pytest.raises(GuideError, match=message):
        guide.next_tokens(batch, torch.tensor([0, 1]))


def test_the_train_preflight_asks_the_guide_about_two_prefixes(capsys):
    """A callable answering one continuation whatever it is asked is refused before Ray starts."""
    import os

    from agents.train import main
    from tests.conftest import ROOT, one_line_cli_error

    line = one_line_cli_error(capsys, main, os.path.join(ROOT, "tune_configs", "ppo_pp_synthetic.yaml"),
                              "--set", "guide.callable=tests.test_guided:wrong_length_guide")
    assert line.startswith("error: guide.callable: tests.test_guided:wrong_length_guide must return a list with one "
                           "continuation per prefix (2), got list of length 1"), line


def test_lm_guide_with_another_vocabulary_is_refused_and_a_matching_one_acts(tmp_path):
    policy_tok = TokenGenerationEnv(ENV_CFG).tokenizer
    other = word_level_tokenizer(["a", "b", "c"])
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(GuideError, match=r"guide\.name_or_path: .*different vocabulary \(5 tokens\) from the "
                                         r"policy's \(32 tokens\)"):
        check_guide_vocabulary(str(tmp_path / "other"), policy_tok)
    # A saved LM with the policy's tokenizer (e.g. a warm start) is a valid guide.
    from agents.models import build_causal_lm
    lm = build_causal_lm({"name_or_path": "tiny-gpt2"}, policy_tok, max_positions=16)
    lm.save_pretrained(tmp_path / "same")
    policy_tok.save_pretrained(tmp_path / "same")
    guide = LMGuide(str(tmp_path / "same"), policy_tok, greedy=True)
    env = TokenGenerationEnv(ENV_CFG)
    obs, _ = env.reset(seed=0)
    batch = {k: torch.as_tensor(np.stack([v, v])) for k, v in obs.items()}
    tokens = guide.next_tokens(batch, torch.tensor([1]))
    assert tokens.shape == (1,) and 0 <= int(tokens[0]) < len(policy_tok)
    # A step the guide sits out breaks its rows' continuity but not its stored prefills (its weights
    # never change): fresh windows seen before are not computed again, and act the same.
    computed = guide.cache.stats["prefill_computed_rows"]
    guide.cache.forget_rows()
    assert torch.equal(guide.next_tokens(batch, torch.tensor([1])), tokens)
    assert guide.cache.stats["prefill_computed_rows"] == computed
    guide.cache.invalidate()  # what the policy's weight sync does: computed again
    assert torch.equal(guide.next_tokens(batch, torch.tensor([1])), tokens)
    assert guide.cache.stats["prefill_computed_rows"] == computed + 1  # the two rows share one window


def _sampling_lm_guide(tmp_path) -> tuple[LMGuide, dict]:
    policy_tok = TokenGenerationEnv(ENV_CFG).tokenizer
    from agents.models import build_causal_lm
    lm = build_causal_lm({"name_or_path": "tiny-gpt2"}, policy_tok, max_positions=16)
    lm.save_pretrained(tmp_path / "guide")
    policy_tok.save_pretrained(tmp_path / "guide")
    obs, _ = TokenGenerationEnv(ENV_CFG).reset(seed=0)
    return LMGuide(str(tmp_path / "guide"), policy_tok, seed=3), {k: torch.as_tensor(np.stack([v] * 64)) for k, v in obs.items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_lm_guide_samples_its_distribution_on_the_rollout_device_from_its_own_generator(tmp_path, device):
    """The guide follows the rollouts' device and draws there, with no host read; its draws come
    from its own generator (torch's global one does not move them), follow its softmax, and a
    saved state repeats them."""
    from tests.test_gradients import HostReads

    guide, batch = _sampling_lm_guide(tmp_path)
    with torch.no_grad():  # a peaked next-token distribution, so a wrong draw shows
        guide.lm.get_output_embeddings().weight.mul_(3.0)
    batch = {k: v.to(device) for k, v in batch.items()}
    rows, cont = torch.arange(64, device=device), torch.ones(64, dtype=torch.bool)  # cont on the host, as the roll-in gives it
    guide.next_tokens(batch, rows)  # moves the guide, prefills its cache
    assert guide.get_state()["device"] == device
    reads = {}
    for greedy in (True, False):  # the draw adds no host read to the step's (the cache's host-side bookkeeping)
        guide.greedy = greedy
        with HostReads() as counter:
            step = guide.next_tokens(batch, rows, cont)
        reads[greedy] = counter.count
    assert reads[False] == reads[True] and step.device.type == device
    # the same windows anew (each call below starts the rows: `set_state` forgets them too)
    guide.cache.forget_rows()
    state = guide.get_state()
    first = guide.next_tokens(batch, rows)
    torch.manual_seed(123)  # the global generator: not the guide's
    guide.set_state(state)
    assert torch.equal(guide.next_tokens(batch, rows), first)
    draws = []
    for _ in range(100):  # 6,400 draws of one state
        guide.cache.forget_rows()
        draws.append(guide.next_tokens(batch, rows).cpu())
    draws = torch.cat(draws)
    guide.cache.forget_rows()
    hidden = guide.cache.hidden_at_last_token(guide.lm.base_model, batch)
    probs = torch.softmax(guide.lm.get_output_embeddings()(hidden[:1]).float(), -1)[0].cpu()
    freq, p = torch.bincount(draws, minlength=len(probs)).double() / len(draws), probs.double()
    assert p.max() > 0.2 and p.max() < 0.9, p.max()
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / len(draws)).sqrt() + 1e-3).all()  # each token within 5 sigma
    assert freq[p < 1e-5].sum() == 0


def test_an_lm_guide_state_saved_on_one_device_waits_for_it(tmp_path):
    """A checkpoint's guide state from another device (a GPU run restored before its guide moved)
    is kept, not applied to the CPU generator, and given back as it was saved; a draw on another
    device drops it (the run goes on from that device's generator, as a later save says)."""
    guide, batch = _sampling_lm_guide(tmp_path)
    theirs = {"generator": torch.Generator("cpu").manual_seed(9).get_state(), "device": "cuda"}
    guide.set_state(theirs)
    assert guide.get_state()["device"] == "cuda" and torch.equal(guide.get_state()["generator"], theirs["generator"])
    rows = torch.arange(64)
    guide.next_tokens(batch, rows)  # drawn on the CPU: the CUDA state is dropped
    after = guide.get_state()
    assert after["device"] == "cpu" and torch.equal(after["generator"], guide.generator.get_state())
    old = {"generator": torch.Generator().manual_seed(5).get_state()}  # a checkpoint from before devices were saved
    guide.set_state(old)  # taken as the CPU's, applied at once
    saved = guide.get_state()
    assert saved["device"] == "cpu" and torch.equal(saved["generator"], old["generator"])
    first = guide.next_tokens(batch, rows)
    guide.set_state(old)
    assert torch.equal(guide.next_tokens(batch, rows), first)


def test_rollout_with_mode_switch_keeps_started_episodes_plans():
    class FixedGuide:
        def next_tokens(self, obs, rows, cont=None):
            return torch.full((len(rows),), 7)

    env = TokenGenerationEnv(ENV_CFG)
    rollout = GuidedRollout(FixedGuide(), max_new_tokens=8, beta=1.0, mix=0.8, mode="ppo_pp", seed=0)
    obs, _ = env.reset(seed=0)
    batch = {k: torch.as_tensor(v)[None] for k, v in obs.items()}
    actions, roles = rollout(batch, torch.tensor([3]))
    assert int(actions[0]) == 7 and int(roles[0]) == GUIDE  # k >= 1: the first step is the guide's
    rollout.set_mode("aggrevated")
    obs, *_ = env.step(7)
    batch = {k: torch.as_tensor(v)[None] for k, v in obs.items()}
    _, roles = rollout(batch, torch.tensor([3]))
    assert int(roles[0]) in (GUIDE, POLICY)  # still the PPO++ plan: never a DEVIATION step
    assert rollout.kind[0] == 1


@pytest.mark.parametrize("raw, message", [
    ({"algorithm": "ppo", "guide": {"beta": 0.3}}, r"^guide: only used by algorithm ppo_pp, aggrevated, lols or dlols"),
    ({"algorithm": "ppo_pp"}, r"^guide: give exactly one of guide\.name_or_path"),
    ({"algorithm": "ppo_pp", "guide": {"callable": "a:b", "name_or_path": "x"}}, r"^guide: give exactly one"),
    ({"algorithm": "ppo_pp", "guide": {"callable": "no_colon"}}, r"^guide\.callable: expected 'module:function'"),
    ({"algorithm": "ppo_pp", "guide": {"callable": "a:b", "beta": 1.5}}, r"^guide\.beta: expected a number in"),
    ({"algorithm": {"grid_search": ["ppo_pp", "dqn"]}, "guide": {"callable": "a:b"}},
     r"^algorithm: a search over algorithms may list the algorithms of one family only \(ppo, ppo_pp"),
    ({"algorithm": "dlols", "guide": {"callable": "a:b"}, "stop": {"training_iteration": None, "time_total_s": 60}},
     r"^guide\.switch_fraction: DLOLS takes it of stop\.training_iteration"),
    ({"algorithm": "ppo_pp", "guide": {"callable": "a:b"}, "reinforce": {"num_samples": 4}},
     r"^reinforce: only used by algorithm reinforce or self_critical"),
])
def test_bad_guided_configs_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def test_a_sweep_over_guided_algorithms_is_one_rllib_algorithm():
    from agents.algorithms.guided import GuidedPPO
    from agents.config import algorithm_config

    cfg = validate({"algorithm": {"grid_search": ["ppo", "ppo_pp", "dlols"]}, "guide": {"callable": GUIDE_SPEC}})
    config = algorithm_config(cfg)
    assert config.algo_class is GuidedPPO
    assert config.guided_algorithm == {"grid_search": ["ppo", "ppo_pp", "dlols"]}
    assert config.switch_iteration == 20  # 0.2 x the default 100 iterations


def test_dlols_run_switches_modes_and_masks_guide_steps(ray_local):
    """Two DLOLS iterations (AggreVaTeD, then PPO++ from iteration 1), then the learner's view of
    a PPO++ batch: guide rows are out of the loss mask, with zero advantage."""
    from agents.config import algorithm_config

    cfg = validate({"algorithm": "dlols", "task": ENV_CFG["task"],
                    "env": {"max_prompt_len": 5, "max_new_tokens": 8},
                    "guide": {"callable": GUIDE_SPEC, "switch_iteration": 1, "beta": 1.0},
                    "training": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
                    "env_runners": {"num_envs_per_env_runner": 4}, "stop": {"training_iteration": 2}})
    algo = algorithm_config(cfg).build_algo()
    try:
        modes = [algo.train()["guide_mode_aggrevated"] for _ in range(2)]
        assert modes == [1.0, 0.0]
        assert algo.env_runner.module.guided.mode == "ppo_pp"
        episodes = algo.env_runner.sample(num_episodes=4, random_actions=False)
        learner = algo.learner_group._learner
        batch = learner._learner_connector(rl_module=learner.module, episodes=episodes, batch={},
                                           shared_data={}, metrics=None)["default_policy"]
        roles = batch[GUIDE_ROLE]
        mask = batch[Columns.LOSS_MASK]
        assert (roles == GUIDE).any() and (roles == POLICY).any()
        assert not mask[roles == GUIDE].any()
        assert (batch[Postprocessing.ADVANTAGES][roles == GUIDE] == 0).all()
        # Every policy step is a loss step (terminated episodes get no artificial bootstrap row).
        assert len(mask) == sum(len(e) for e in episodes)
        assert int(mask.sum()) == int((roles == POLICY).sum())
    finally:
        algo.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_ppo_pp_with_an_lm_guide_trains_with_its_rollouts_on_the_learners_device(ray_local, tmp_path, device):
    """PPO++ with a causal-LM guide: two iterations train, the guide rolls in (its steps out of the
    loss), and with a GPU learner the rollouts, the guide included, run on the learner's GPU."""
    from agents.config import algorithm_config
    from agents.models import build_causal_lm

    tokenizer = TokenGenerationEnv(ENV_CFG).tokenizer
    build_causal_lm({"name_or_path": "tiny-gpt2"}, tokenizer, seed=5, max_positions=16).save_pretrained(tmp_path / "g")
    tokenizer.save_pretrained(tmp_path / "g")
    raw = {"algorithm": "ppo_pp", "task": ENV_CFG["task"], "env": {"max_prompt_len": 5, "max_new_tokens": 8},
           "guide": {"name_or_path": str(tmp_path / "g"), "beta": 1.0},
           "training": {"train_batch_size": 128, "minibatch_size": 64, "num_epochs": 1},
           "env_runners": {"num_envs_per_env_runner": 4}}
    if device == "cuda":
        raw["learners"] = {"num_gpus_per_learner": 1}
    algo = algorithm_config(validate(raw)).build_algo()
    try:
        results = [algo.train() for _ in range(2)]
        module = algo.env_runner.module
        assert next(module.parameters()).device.type == device
        assert module.guided.guide.lm.device.type == device
        episodes = algo.env_runner.sample(num_episodes=4, random_actions=False)
        roles = np.concatenate([e.get_extra_model_outputs(GUIDE_ROLE) for e in episodes])
        assert (roles == GUIDE).any() and (roles == POLICY).any()
        assert all(np.isfinite(r["learners"]["default_policy"]["total_loss"]) for r in results)
    finally:
        algo.stop()


def test_guided_comparison_reads_policy_returns_and_merges_experiments(tmp_path, capsys):
    """The benchmark table: guided trials are read through policy_return_mean (NaN rows skipped),
    plain ones through the episode return; comma-joined experiments pool their seeds."""
    import json
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    import guided_comparison

    def trial(exp, name, rows):
        d = tmp_path / exp / name
        d.mkdir(parents=True)
        with open(d / "result.json", "w") as f:
            for steps, ret, pol in rows:
                r = {"env_runners": {"num_env_steps_sampled_lifetime": steps, "episode_return_mean": ret}}
                if pol is not None:
                    r["guide_mode_aggrevated"] = 0.0
                    r["env_runners"]["policy_return_mean"] = pol
                f.write(json.dumps(r) + "\n")

    trial("ppo", "t0", [(100, 0.5, None), (200, 0.7, None)])
    trial("ppo_b", "t1", [(100, 0.6, None), (200, 0.9, None)])
    trial("pp", "t0", [(100, 0.99, float("nan")), (200, 0.99, 0.75), (300, 0.99, 0.85)])
    assert guided_comparison.trial_curve(str(tmp_path / "pp" / "t0")) == [(200, 0.75), (300, 0.85)]
    guided_comparison.main([f"{tmp_path}/ppo,{tmp_path}/ppo_b", str(tmp_path / "pp"), "--levels", "0.6"])
    out = capsys.readouterr().out
    assert "reference level 0.8" in out  # mean of the pooled PPO seeds' final rewards (0.7, 0.9)
    ppo_row = next(line for line in out.splitlines() if line.startswith("| ppo |"))
    pp_row = next(line for line in out.splitlines() if line.startswith("| pp |"))
    assert ppo_row.split("|")[2].strip() == "2" and "0.800 ± 0.141" in ppo_row
    assert ppo_row.split("|")[5].strip() == "150"  # 0.6 first reached at 200 and at 100 steps
    assert ppo_row.split("|")[6].strip() == "1/2 seeds (mean 200)"  # only one seed reached 0.8
    assert pp_row.split("|")[5].strip() == "200" and pp_row.split("|")[6].strip() == "300"


@pytest.mark.slow
def test_ppo_pp_cli_runs_the_shipped_config_and_summarises_policy_alone_episodes(tmp_path, capsys):
    import os
    import re

    from agents.train import main

    yaml = os.path.join(os.path.dirname(__file__), "..", "tune_configs", "ppo_pp_synthetic.yaml")
    sets = ["stop.training_iteration=3", "training.train_batch_size=512", "training.minibatch_size=128",
            f"tune.storage_path={tmp_path}", "generate.num_samples=0"]
    code = main([yaml, *sum((["--set", s] for s in sets), []), "--set", "tune.name=null"])
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    # an unnamed run gets a name, says how to resume it, and its saved config takes that name
    from agents.config import load
    from agents.resume import resume_differences

    name = re.search(r"\(resume it with --resume --set tune.name=(run-\d{8}-\d{6})\)$", out.out, re.M).group(1)
    assert os.path.isfile(tmp_path / name / "run_config.json")
    assert resume_differences(load(yaml, [*sets, f"tune.name={name}"])) == []
    assert len(re.findall(r"^iter +\d+ .* policy \d\.\d{3} ", out.out, re.M)) == 3
    # The summary follows the episodes the policy wrote alone, and says so.
    assert re.search(r"policy-alone episode reward \d\.\d{3} \(iteration 1\) -> \d\.\d{3} \(iteration 3\)", out.out)
