"""Sequence-level policy gradient: REINFORCE's per-prompt baseline and self-critical's greedy baseline."""
import copy

import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing

from agents.algorithms.reinforce import SequenceLevelAdvantages, per_prompt_baselines
from env.text_env import RepeatedPromptEnv
from agents.config import ConfigError, validate
from agents.modules import CausalLMActorCritic
from env.text_env import TokenGenerationEnv

ENV_CFG = {"task": {"name": "increasing_numbers", "num_numbers": 20}, "max_prompt_len": 4, "max_new_tokens": 6}


class Episode:
    """The two things the advantage connector reads from an RLlib episode, and its length."""

    def __init__(self, obs0, info0, length):
        self.obs0, self.info0, self.length = obs0, info0, length

    def get_observations(self, i):
        return self.obs0

    def get_infos(self, i):
        return self.info0

    def __len__(self):
        return self.length


class Connector(SequenceLevelAdvantages):
    def single_agent_episode_iterator(self, episodes, **kwargs):
        return iter(episodes)


def test_per_prompt_baseline_is_the_sample_mean_of_each_prompts_group():
    keys = ["a", "b", "a", "a", "b", "a", "a"]
    returns = np.array([1.0, 0.2, 0.0, 0.5, 0.4, 0.25, 0.9])
    baselines = per_prompt_baselines(keys, returns, num_samples=4)
    # prompt a: episodes 0, 2, 3, 5 form the first group of 4, episode 6 is a group of its own
    a = (1.0 + 0.0 + 0.5 + 0.25) / 4
    np.testing.assert_allclose(baselines, [a, 0.3, a, a, 0.3, a, 0.9])


def test_repeated_prompt_env_draws_each_prompt_num_samples_times_with_its_meta():
    env = RepeatedPromptEnv({**ENV_CFG, "repeat_prompt": 3})
    env.examples = [{"prompt": f"{i} {i + 1}", "meta": {"i": i}} for i in range(5)]
    seen = []
    for i in range(9):
        _, info = env.reset(seed=1 if i == 0 else None)
        seen.append((info["prompt"], info["meta"]["i"]))
    assert all(seen[g * 3] == seen[g * 3 + 1] == seen[g * 3 + 2] for g in range(3))
    assert all(p == f"{i} {i + 1}" for p, i in seen)


def test_repeated_prompt_groups_go_on_across_seeded_resets():
    # RLlib resets with a new seed at every sample() call and a call gives each row about one
    # episode, so a group that restarted at each seed would hold one episode (advantage 0).
    env = RepeatedPromptEnv({**ENV_CFG, "repeat_prompt": 3})
    env.examples = [{"prompt": f"{i} {i + 1}", "meta": {"i": i}} for i in range(50)]
    seen = [env.reset(seed=100 + i)[1]["meta"]["i"] for i in range(9)]
    assert [seen[g * 3] for g in range(3)] == [seen[g * 3 + 2] for g in range(3)]
    assert seen[0:3] == [seen[0]] * 3 and seen[3:6] == [seen[3]] * 3 and seen[6:9] == [seen[6]] * 3
    assert len(set(seen)) > 1


def test_reinforce_advantage_is_the_return_minus_the_prompts_mean():
    env = TokenGenerationEnv(ENV_CFG)
    obs_a, _ = env.reset(options={"prompt": "1 2"})
    obs_b, _ = env.reset(options={"prompt": "3"})
    lens = [3, 2, 4, 2]  # rows per episode, each with RLlib's artificial last row
    eps = [Episode(o, {}, n) for o, n in zip([obs_a, obs_b, obs_a, obs_b], lens)]
    rewards = torch.tensor([0, 0.6, 0, 0, 0.1, 0, 0, 0.2, 0, 0, 0.5], dtype=torch.float32)
    loss_mask = torch.tensor([1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 0], dtype=torch.bool)
    batch = {"default_policy": {Columns.REWARDS: rewards, Columns.LOSS_MASK: loss_mask}}
    out = Connector(baseline="mean", num_samples=2)(rl_module=None, batch=batch, episodes=eps)["default_policy"]
    # prompt "1 2": returns 0.6 and 0.2 -> baseline 0.4; prompt "3": 0.1 and 0.5 -> 0.3
    expected = np.repeat([0.6 - 0.4, 0.1 - 0.3, 0.2 - 0.4, 0.5 - 0.3], lens) * loss_mask.numpy()
    np.testing.assert_allclose(out[Postprocessing.ADVANTAGES].numpy(), expected, atol=1e-6)


def test_self_critical_baseline_is_the_reward_of_the_greedy_decode():
    env = TokenGenerationEnv(ENV_CFG)
    module = CausalLMActorCritic(observation_space=env.observation_space, action_space=env.action_space,
                                 model_config={"model": {"name_or_path": "tiny-gpt2"}, "env": ENV_CFG, "seed": 3})
    # The untrained model copies its last token; an output layer shifted by one row makes it
    # count up instead, so greedy decodes earn different, non-zero rewards.
    w = module.lm.get_input_embeddings().weight.detach()
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    head.weight.data = torch.roll(w, 1, 0).clone()
    module.lm.set_output_embeddings(head)
    prompts = ["1 2", "15", "1 2"]
    # The greedy decode, done independently: argmax of the module's acting logits, step by step in the env.
    expected = []
    for p in prompts:
        obs, _ = env.reset(options={"prompt": p})
        done, reward = False, 0.0
        while not done:
            batch = {k: torch.as_tensor(v)[None] for k, v in obs.items()}
            with torch.no_grad():
                logits = module.forward_inference({Columns.OBS: batch})[Columns.ACTION_DIST_INPUTS]
            obs, reward, done, _, _ = env.step(int(logits.argmax(-1)[0]))
        expected.append(reward)
    firsts = [env.reset(options={"prompt": p})[0] for p in prompts]
    connector = Connector(baseline="greedy")
    baselines = connector.greedy_baselines(module, [Episode(o, {"meta": {}}, 7) for o in firsts])
    np.testing.assert_allclose(expected, [1.0, 0.6, 1.0])  # "3 4 5 6 7 8"; "16 17 18 19" then EOS
    np.testing.assert_allclose(baselines, expected)
    # and the advantage of each episode is its own return minus that baseline
    rewards = torch.zeros(21)
    rewards[[6, 13, 20]] = torch.tensor([0.9, 0.1, 0.4])
    batch = {"default_policy": {Columns.REWARDS: rewards}}
    module_dict = {"default_policy": type("W", (), {"unwrapped": lambda self: module})()}
    out = connector(rl_module=module_dict, batch=batch, episodes=[Episode(o, {"meta": {}}, 7) for o in firsts])
    adv = out["default_policy"][Postprocessing.ADVANTAGES].numpy()
    np.testing.assert_allclose(adv[[0, 7, 14]], np.array([0.9, 0.1, 0.4]) - np.array(expected), atol=1e-6)


@pytest.mark.parametrize("raw, message", [
    ({"algorithm": "ppo", "reinforce": {"num_samples": 4}}, r"^reinforce: only used by algorithm reinforce or self_critical"),
    ({"algorithm": "reinforce", "reinforce": {"num_samples": 1}}, r"^reinforce\.num_samples: expected an integer >= 2"),
    ({"algorithm": "self_critical", "guide": {"callable": "a:b"}}, r"^guide: only used by algorithm ppo_pp, aggrevated, lols or dlols"),
])
def test_bad_sequence_level_configs_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def test_reinforce_training_uses_each_prompts_group_mean_as_its_baseline(ray_local, tmp_path, monkeypatch):
    """One training iteration on a task with 8 prompts: the baselines the learner used are, for
    every episode, the mean return of the episodes of its prompt group (up to num_samples episodes
    of one prompt, in batch order), recomputed here from the episodes themselves."""
    from collections import Counter, defaultdict

    from agents.algorithms.reinforce import Reinforce
    from agents.config import algorithm_config
    from env.tasks.text_tasks import clear_cache
    from tests.test_mle import dialogue_config

    seen = []  # what the learner's advantage piece received, per call
    original = SequenceLevelAdvantages.__call__

    def recording(self, *, rl_module, batch, episodes, **kwargs):
        eps = list(self.single_agent_episode_iterator(episodes, agents_that_stepped_only=False))
        out = original(self, rl_module=rl_module, batch=batch, episodes=episodes, **kwargs)
        seen.append((eps, None if self.last_baselines is None else self.last_baselines.copy()))
        return out

    monkeypatch.setattr(SequenceLevelAdvantages, "__call__", recording)
    clear_cache()
    cfg = dialogue_config(tmp_path, "reinforce.num_samples=4", algorithm="reinforce",
                          training="{lr: 1.0e-3, train_batch_size: 128, minibatch_size: 128, num_epochs: 1}")
    config = algorithm_config(cfg)
    assert config.algo_class is Reinforce
    algo = config.build_algo()
    try:
        before = {k: v.clone() for k, v in algo.learner_group._learner.module["default_policy"].lm.state_dict().items()}
        learner = algo.train()["learners"]["default_policy"]
        after = algo.learner_group._learner.module["default_policy"].lm.state_dict()
    finally:
        algo.stop()
        clear_cache()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the sequence-level loss updated the policy

    assert len(seen) == 1
    eps, used = seen[0]
    returns = np.array([float(np.sum(e.get_rewards())) for e in eps])  # reward.kl_coef is 0: the task reward
    prompts = [tuple(np.asarray(e.get_observations(0)["input_ids"])[np.asarray(e.get_observations(0)["attention_mask"]) == 1])
               for e in eps]
    # Groups by hand: the k-th episode of a prompt (in batch order) is in that prompt's group k // 4.
    count, members = Counter(), defaultdict(list)
    group_of = []
    for i, p in enumerate(prompts):
        group_of.append((p, count[p] // 4))
        count[p] += 1
        members[group_of[-1]].append(i)
    expected = np.array([returns[members[g]].mean() for g in group_of])
    # The batch can tell a right grouping from a wrong one: several prompts, groups of several
    # episodes, and baselines that are neither each episode's own return nor one batch-wide mean.
    assert len(set(prompts)) > 1 and max(len(m) for m in members.values()) > 1
    assert not np.allclose(expected, returns) and not np.allclose(expected, returns.mean())
    np.testing.assert_allclose(used, expected, atol=1e-6)
    # and what the learner logs follows from those baselines
    assert learner["sequence_return_mean"] == pytest.approx(returns.mean(), abs=1e-6)
    assert learner["advantage_abs_mean"] == pytest.approx(np.abs(returns - expected).mean(), abs=1e-6)


LONG_CFG = {**ENV_CFG, "max_new_tokens": 12}  # 1 + 8 + 3 steps: a greedy decode's first step and two blocks


def counting_module(seed=3, sampler=None):
    """tiny-gpt2 whose output layer is shifted by one row, so greedy decodes count up (and some
    rows meet EOS after 20) instead of copying the last token."""
    env = TokenGenerationEnv(LONG_CFG)
    module = CausalLMActorCritic(observation_space=env.observation_space, action_space=env.action_space,
                                 model_config={"model": {"name_or_path": "tiny-gpt2"}, "env": LONG_CFG, "seed": seed,
                                               "sampler": sampler or {"name": "none"}})
    w = module.lm.get_input_embeddings().weight.detach()
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    head.weight.data = torch.roll(w, 1, 0).clone()
    module.lm.set_output_embeddings(head)
    if module.sampler.learned:  # NLPO's masking policy: a copy of the policy as it now is
        module.mask_lm.set_output_embeddings(copy.deepcopy(head).requires_grad_(False))
    return env, module


def reference_greedy(module, ids, mask, max_new_tokens, eos_id):
    """Argmax decoding by a whole-window pass per step (no cache), the sampler's mask applied."""
    out, done = [[] for _ in range(len(ids))], torch.zeros(len(ids), dtype=torch.bool)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            obs = {"input_ids": ids, "attention_mask": mask}
            logits = module._logits(module.lm, module._hidden(module._trunk(module.lm), obs)).float()
            if module.sampler.active and not module.sampler.stateful:
                source = module.mask_lm_logits(obs) if module.sampler.learned else logits
                logits = logits.masked_fill(~module.sampler.keep(source, None), -torch.inf)
            token = logits.argmax(-1)
            for r in torch.nonzero(~done)[:, 0].tolist():
                out[r].append(int(token[r]))
            done |= token == eos_id
            ids = torch.cat([ids[:, 1:], token[:, None]], 1)
            mask = torch.cat([mask[:, 1:], torch.ones_like(mask[:, :1])], 1)
    return out


def prompt_windows(env, prompts):
    firsts = [env.reset(options={"prompt": p})[0] for p in prompts]
    return (torch.as_tensor(np.stack([f["input_ids"] for f in firsts])),
            torch.as_tensor(np.stack([f["attention_mask"] for f in firsts])))


CALLS = [["1 2", "15", "9"], ["12 13", "2", "18", "4 5", "17"], ["16", "3"]]  # 3, 5 and 2 prompts


@pytest.mark.parametrize("sampler, engine", [(None, True), ({"name": "top_k", "k": 3}, True), (None, False),
                                             ({"name": "top_k", "k": 3, "masking": "learned"}, True)])
def test_greedy_decodes_across_calls_and_weight_updates_equal_a_whole_window_argmax(sampler, engine):
    """One `Decoder` over six calls (3, 5 and 2 prompts, so padded rows; rows that meet EOS
    early and rows that never do; each prompt decoded twice), the weights changed in place between
    calls as an optimizer does: each call's decodes are the argmax of a whole-window pass per step
    with the weights of the call. Without the decode engine (a trunk it does not serve), or with a
    learned mask (NLPO's masking policy, which reads the window), one call per step gives the same."""
    from agents.modules.decoding import Decoder

    env, module = counting_module(sampler=sampler)
    decoder = Decoder()
    decoder.cache.use_engine = engine
    g = torch.Generator().manual_seed(0)
    decodes = []
    for i, prompts in enumerate(CALLS * 2):
        ids, mask = prompt_windows(env, prompts)
        got = decoder(module, ids, mask, env.max_new_tokens, env.eos_id)
        assert got == reference_greedy(module, ids, mask, env.max_new_tokens, env.eos_id), i
        decodes += got
        with torch.no_grad():
            module.lm.base_model.h[0].mlp.c_fc.weight.add_(0.02 * torch.randn(
                module.lm.base_model.h[0].mlp.c_fc.weight.shape, generator=g))
    assert any(len(r) == env.max_new_tokens for r in decodes) and any(r[-1] == env.eos_id for r in decodes)
    assert decoder.rows == 8 and (decoder.cache.engine is not None) == engine


def test_greedy_decodes_replay_the_graphs_of_the_first_calls():
    """With the engine's capture emulated on the CPU, calls with 3, 5 and 2 prompts use one engine
    (8 rows) and capture no new graph once the restart step has one: the blocks replay, and the
    decodes are a whole-window argmax's, after weight updates too."""
    from agents.modules.decoding import Decoder
    from benchmarks.emulated_capture import OpCounter, emulate_capture

    env, module = counting_module()
    counter = OpCounter()
    with emulate_capture(counter):
        captured = Decoder()
        graphs, engines = [], []
        for prompts in CALLS * 2:
            ids, mask = prompt_windows(env, prompts)
            got = captured(module, ids, mask, env.max_new_tokens, env.eos_id)
            assert got == reference_greedy(module, ids, mask, env.max_new_tokens, env.eos_id)
            graphs.append(set(captured.cache.engine.graphs))
            engines.append(captured.cache.engine)
            with torch.no_grad():
                module.lm.base_model.h[1].attn.c_proj.weight.mul_(1.1)
    assert all(e is engines[0] for e in engines) and engines[0].capture
    assert graphs[-1] == graphs[2] and any(name[0] == "steps" for name in graphs[-1]), graphs
    assert counter.replays > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_decodes_on_cuda_replay_their_graphs_and_equal_the_eager_decodes():
    """On a GPU the greedy decoder's engine captures its steps as CUDA graphs: calls with 3, 5 and 2
    prompts, the weights changed in place between them, give the eager engine's decodes, and no
    graph is captured after the second call."""
    from agents.modules.decoding import Decoder

    env, module = counting_module()
    module = module.cuda()
    captured, eager = Decoder(), Decoder()
    eager.cache.capture = False
    graphs = []
    for prompts in CALLS * 2:
        ids, mask = (t.cuda() for t in prompt_windows(env, prompts))
        got = captured(module, ids, mask, env.max_new_tokens, env.eos_id)
        assert got == eager(module, ids, mask, env.max_new_tokens, env.eos_id)
        assert captured.cache.engine.capture and not eager.cache.engine.capture
        graphs.append(set(captured.cache.engine.graphs))
        with torch.no_grad():
            module.lm.base_model.h[1].attn.c_proj.weight.mul_(1.1)
    assert graphs[-1] == graphs[1] and any(name[0] == "steps" for name in graphs[-1]), graphs


def test_greedy_profile_counts_a_calls_replays_and_captures_no_graph_after_the_second():
    """`decode_step_profile.py --greedy --emulate-capture` on the CPU: 12 new tokens are the first
    step and two blocks (3 replays a call), and from the third call on no graph is captured."""
    import os
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "benchmarks/decode_step_profile.py", "--greedy", "--emulate-capture",
                          "--device", "cpu", "--model", "tiny-gpt2", "--vocab", "52", "--batch", "16",
                          "--prompt", "4", "--new", "12"], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    calls = re.findall(r"greedy call (\d): +[\d.]+ ms +(\d+) ops outside graphs +(\d+) replays +(\d+) graphs captured",
                       out.stdout)
    assert len(calls) == 6, out.stdout
    assert all(int(replays) == 3 for _, _, replays, _ in calls)
    assert [int(c[3]) for c in calls[2:]] == [0, 0, 0, 0] and int(calls[0][3]) > 0
    assert len({c[1] for c in calls[2:]}) == 1  # the same ops outside the graphs at every call
