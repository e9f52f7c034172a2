"""EnvRunners: new prompts on every sample() of whole episodes, reproducibly per seed; the fast
runner's episodes, cache use and metrics."""

import numpy as np
import pytest
import torch

from agents.config import algorithm_config, validate
from agents.env_runner import FastTokenEnvRunner, StockTokenEnvRunner

SEQ2SEQ = {"task": {"name": "sort_numbers"}, "model": {"name_or_path": "tiny-t5"},
           "env": {"max_prompt_len": 5, "max_new_tokens": 3},
           "training": {"train_batch_size": 64, "minibatch_size": 32},
           "env_runners": {"num_envs_per_env_runner": 4}}
CAUSAL = {"task": {"name": "increasing_numbers", "num_numbers": 20}, "model": {"name_or_path": "tiny-gpt2"},
          "env": {"max_prompt_len": 5, "max_new_tokens": 6},
          "training": {"train_batch_size": 96, "minibatch_size": 32},
          "env_runners": {"num_envs_per_env_runner": 8}}


def with_runner(raw: dict, runner: str) -> dict:
    return validate({**raw, "env_runners": {**raw["env_runners"], "runner": runner}})


def first_prompts(runner, calls=2):
    out = []
    for _ in range(calls):
        episodes = runner.sample(num_episodes=4)
        out.append(sorted(tuple(e.get_observations(0)["encoder_input_ids"].tolist()) for e in episodes))
    return out


@pytest.mark.parametrize("kind,cls", [("fast", FastTokenEnvRunner), ("stock", StockTokenEnvRunner)])
def test_each_sample_call_draws_new_prompts_and_a_seed_repeats_them(kind, cls):
    config = algorithm_config(with_runner(SEQ2SEQ, kind))
    assert config.env_runner_cls is cls
    runner = cls(config=config)
    first, second = first_prompts(runner)
    # RLlib reseeds the vector env with the same seed before every such call; without the
    # shifted seed (stock) or the single seeding (fast) both calls would hold the same four prompts.
    assert len(set(first) & set(second)) == 0
    again = first_prompts(cls(config=config))
    assert again == [first, second]  # same seed, same prompts
    runner.stop()


def test_default_runner_is_fast_except_dqn():
    assert algorithm_config(validate(CAUSAL)).env_runner_cls is FastTokenEnvRunner
    dqn = validate({**CAUSAL, "algorithm": "dqn", "training": {"train_batch_size": 32}})
    assert algorithm_config(dqn).env_runner_cls is StockTokenEnvRunner


def full_pass_logp(module, episode, every_token: bool = False) -> np.ndarray:
    """Each action's log-prob (`every_token`: every token's, (steps, vocabulary)) from an uncached
    forward over the episode's recorded windows (masked by the module's sampler where it is
    stateless, as the rollout's were)."""
    obs = {k: torch.as_tensor(v[:-1]) for k, v in episode.get_observations().items()}
    with torch.no_grad():
        logits, _ = module._masked_logits(module._hidden(module._trunk(module.lm), obs))
    logp = torch.log_softmax(logits, -1)
    if every_token:
        return logp.numpy()
    return logp.gather(-1, torch.as_tensor(episode.get_actions())[:, None])[:, 0].numpy()


def test_fast_runner_episodes_are_complete_and_consistent():
    config = algorithm_config(validate(CAUSAL))
    runner = FastTokenEnvRunner(config=config)
    episodes = runner.sample()  # no arguments: this EnvRunner's share of the train batch
    steps = sum(len(e) for e in episodes)
    assert steps >= 96
    env = runner.env.unwrapped
    for e in episodes:
        assert e.is_done and e.is_numpy and e.is_terminated
        obs, actions = e.get_observations(), e.get_actions()
        ids, mask = obs["input_ids"], obs["attention_mask"]
        assert ids.shape == (len(e) + 1, env.seq_len)
        # the transition: every observation is the previous one shifted by the action taken
        assert (ids[1:, -1] == actions).all() and (ids[1:, :-1] == ids[:-1, 1:]).all()
        assert (mask[1:, -1] == 1).all()
        # it ends on EOS or at the horizon, and only there
        assert actions[-1] == env.eos_id or len(e) == env.max_new_tokens
        assert (actions[:-1] != env.eos_id).all()
        rewards = e.get_rewards()
        assert (rewards[:-1] == 0).all()  # sparse reward
        info = e.get_infos(-1)
        assert info["num_generated"] == len(e)
        assert rewards[-1] == pytest.approx(env.rows[0].score([info["prompt"]], [info["generation"]], [{}])[0])
        logp = e.get_extra_model_outputs("action_logp")
        assert logp.shape == (len(e),) and (logp <= 0).all()
    metrics = runner.get_metrics()
    assert float(metrics["num_episodes"]) == len(episodes)
    # the steps taken are those returned plus those of the episodes still running, which the
    # next call finishes (no call waits for its slowest rows)
    st = runner._rollout
    running = sum(st.n - st.row_start[i] for i in np.flatnonzero(st.active))
    assert float(metrics["num_env_steps_sampled"]) == steps + running > steps
    more = runner.sample()
    assert float(runner.get_metrics()["num_env_steps_sampled"]) + running >= sum(len(e) for e in more)
    assert {e.id_ for e in more}.isdisjoint(e.id_ for e in episodes)
    returns = [e.get_return() for e in episodes]
    assert float(metrics["episode_return_mean"]) == pytest.approx(np.mean(returns[-100:]))
    runner.stop()


def test_without_carry_every_training_call_returns_only_episodes_it_sampled_whole():
    """env_runners.carry_episodes: false finishes the running episodes in the call: each batch is
    sampled by one set of weights, and nothing is left over for the next call."""
    raw = {**CAUSAL, "env_runners": {**CAUSAL["env_runners"], "carry_episodes": False}}
    runner = FastTokenEnvRunner(config=algorithm_config(validate(raw)))
    for _ in range(3):
        episodes = runner.sample()
        steps = sum(len(e) for e in episodes)
        assert steps >= 96 and all(e.is_done for e in episodes)
        # every step taken in the call is in a returned episode, and none was taken before it
        assert float(runner.get_metrics()["num_env_steps_sampled"]) == steps
        assert not runner._rollout.active.any()
        # the log-probs are the current weights': a changed policy samples the next call
        with torch.no_grad():
            for p in runner.module.lm.get_output_embeddings().parameters():
                p.add_(0.5 * torch.randn_like(p))
        runner.set_state(runner.get_state())  # a weight sync, as after an update
        more = runner.sample()
        assert float(runner.get_metrics()["num_env_steps_sampled"]) == sum(len(e) for e in more) >= 96
        for e in more:
            assert np.allclose(full_pass_logp(runner.module, e), e.get_extra_model_outputs("action_logp"), atol=1e-5)
    runner.stop()


def test_fast_runner_prefills_only_rows_that_start_and_logp_matches_a_full_pass():
    config = algorithm_config(validate(CAUSAL))
    runner = FastTokenEnvRunner(config=config)
    module = runner.module
    episodes = runner.sample(num_timesteps=200)
    stats = module.kv_cache.stats
    # each episode's first step is its row's one prefill (the returned ones and those still running
    # that the module saw already); every other module step is one cached token
    st = runner._rollout
    assert stats["prefill_rows"] == len(episodes) + (st.active & st.cont).sum()
    # the stored log-prob of each action equals an uncached forward over the window
    e = episodes[0]
    assert np.allclose(full_pass_logp(module, e), e.get_extra_model_outputs("action_logp"), atol=1e-5)
    # a weight sync drops the cache: the next call starts from prefills again
    runner.set_state(runner.get_state())
    assert module.kv_cache.layers is None
    runner.stop()


def test_fast_runner_greedy_evaluation_is_argmax():
    config = algorithm_config(validate(CAUSAL))
    runner = FastTokenEnvRunner(config=config)
    episodes = runner.sample(num_episodes=5, explore=False)
    assert len(episodes) == 5
    module = runner.module
    for e in episodes:
        obs = {k: torch.as_tensor(v[:-1]) for k, v in e.get_observations().items()}
        with torch.no_grad():
            logits = module._logits(module.lm, module._hidden(module._trunk(module.lm), obs))
        assert (logits.argmax(-1).numpy() == e.get_actions()).all()
    runner.stop()


def test_rollout_values_are_the_learner_modules_values_and_gae_reads_them():
    """The EnvRunner stores V(s) of each step (the value head on the policy's trunk); they equal
    the learner module's value pass on the same weights, which GAE then skips."""
    from ray.rllib.core.columns import Columns

    config = algorithm_config(validate(CAUSAL))
    runner = FastTokenEnvRunner(config=config)
    m = runner.module
    learner_module = type(m)(observation_space=m.observation_space, action_space=m.action_space,
                             inference_only=False, model_config=m.model_config)
    torch.nn.init.normal_(learner_module.value_head.weight)  # a value head that is not all zeros
    runner.module.set_state(learner_module.get_state(inference_only=True))
    episodes = runner.sample(num_timesteps=60)
    assert len(episodes) >= 3
    for e in episodes[:3]:
        obs = {k: torch.as_tensor(v[:-1]) for k, v in e.get_observations().items()}
        computed = learner_module.compute_values({Columns.OBS: obs}).detach()  # no stored values: a forward pass
        assert computed.abs().max() > 0
        stored = e.get_extra_model_outputs(Columns.VF_PREDS)
        assert np.allclose(stored, computed.numpy(), atol=1e-5)
        batch = {Columns.OBS: obs, Columns.VF_PREDS: torch.as_tensor(stored) + 1.0,
                 Columns.TRUNCATEDS: torch.zeros(len(stored), dtype=torch.bool)}
        assert torch.equal(learner_module.compute_values(batch), torch.as_tensor(stored, dtype=torch.float32) + 1.0)
        batch[Columns.TRUNCATEDS][-1] = True  # a cut episode needs the state after its last step: computed
        assert np.allclose(learner_module.compute_values(batch).detach().numpy(), computed.numpy(), atol=1e-5)
    runner.stop()


def test_a_separate_value_trunk_stays_on_the_learner():
    config = algorithm_config(validate({**CAUSAL, "model": {**CAUSAL["model"], "value_model": "separate"}}))
    runner = FastTokenEnvRunner(config=config)
    assert not hasattr(runner.module, "value_head")
    episodes = runner.sample(num_timesteps=20)
    assert "vf_preds" not in episodes[0].extra_model_outputs
    runner.stop()


@pytest.mark.parametrize("sampler, captured", [(None, None), (None, "restarts in the step"), (None, "eager restarts"),
                                               ({"name": "top_k", "k": 5}, None), ({"name": "mirostat", "tau": 2.0}, None)])
def test_decode_blocks_sample_what_the_env_steps_through(sampler, captured, monkeypatch):
    """env_runners.decode_block 4: the module runs 4 steps per env round trip, appending its own
    tokens to the windows on its device. Each episode's stored log-probs are still those of the
    windows the env recorded (a full pass's, masked by the sampler where it is stateless), also for
    rows restarted between blocks and rows carried from one call to the next on their cache, and
    after a weight sync; a stateful sampler (mirostat) runs through blocks too. `captured`: the
    decode engine's graphs (the block's steps after the first in one graph, restarts inside the
    step or eager) captured and replayed on the CPU, as a GPU runs them."""
    from agents.modules.decode_engine import DecodeEngine
    from benchmarks.emulated_capture import capturing_init

    raw = {**CAUSAL, "env_runners": {**CAUSAL["env_runners"], "decode_block": 4}}
    if sampler:
        raw["sampler"] = sampler
    if captured:
        monkeypatch.setattr(DecodeEngine, "__init__", capturing_init())
    runner = FastTokenEnvRunner(config=algorithm_config(validate(raw)))
    runner.module.kv_cache.static_restarts = None if captured != "eager restarts" else False
    module, blocks = runner.module, []
    act_steps = module.act_steps
    module.act_steps = lambda batch, steps, explore=True: blocks.append(steps) or act_steps(batch, steps, explore)
    carried = 0
    for call in range(4):
        episodes = runner.sample()
        assert sum(len(e) for e in episodes) >= 96
        for e in episodes:
            if sampler is None or sampler["name"] == "top_k":
                assert np.allclose(full_pass_logp(module, e), e.get_extra_model_outputs("action_logp"), atol=1e-5)
        carried += int(runner._rollout.active.sum())
        if call == 2:
            runner.set_state(runner.get_state())  # a weight sync: the carried rows are prefilled anew
    assert blocks and set(blocks) == {4} and carried > 0
    assert module.kv_cache.stats["incremental_rows"] > 0
    if captured:  # a block's steps after the first are one graph; its first step restarts rows in it or not
        kinds = {name[0] for name in module.kv_cache.engine.graphs if isinstance(name, tuple)}
        assert "steps" in kinds and ("restart" in kinds) == (captured == "restarts in the step")
        # restarts that cost no eager prefill: finished rows restart at once, on windows never seen too
        assert module.kv_cache.restarts_in_step == (captured == "restarts in the step")
        runner.weights_changed()
        runner._restarts.note_windows(runner._rollout.obs, np.arange(2))
        assert runner._restarts.free == (captured == "restarts in the step")
    runner.stop()


def greedy_episodes(raw: dict, block: int, captured: bool, monkeypatch) -> tuple[list, list]:
    """Two greedy `sample(num_episodes=12)` calls of a fresh runner (a weight sync between them):
    (prompt, actions, log-probs) per episode, the steps of each `act_steps` call, and the names of
    the decode engine's graphs where the greedy step is static (else None)."""
    from agents.modules.acting import static_rollout_step
    from agents.modules.decode_engine import DecodeEngine
    from benchmarks.emulated_capture import capturing_init

    if captured:
        monkeypatch.setattr(DecodeEngine, "__init__", capturing_init())
    runner = FastTokenEnvRunner(config=algorithm_config(validate(
        {**raw, "env_runners": {**raw["env_runners"], "decode_block": block}})))
    module, blocks = runner.module, []
    act_steps = module.act_steps
    module.act_steps = lambda batch, steps, explore=True: blocks.append((steps, explore)) or act_steps(
        batch, steps, explore)
    out = []
    for call in range(2):
        for e in runner.sample(num_episodes=12, explore=False):
            out.append((e.get_observations(0)["input_ids"].tolist(), e.get_actions().tolist(),
                        e.get_extra_model_outputs("action_logp")))
            if module._static_tail():  # each token the argmax of an uncached pass over its window, masked
                logp = full_pass_logp(module, e, every_token=True)
                assert (logp.argmax(-1) == e.get_actions()).all()
                np.testing.assert_allclose(logp.max(-1), out[-1][2], atol=1e-5)
        runner.set_state(runner.get_state())
    graphs = set(getattr(getattr(module.kv_cache, "engine", None), "graphs", {}))
    static = static_rollout_step(module, explore=False)
    runner.stop()
    monkeypatch.undo()
    return out, blocks, graphs if static else None


@pytest.mark.parametrize("raw, captured", [
    (CAUSAL, False), (CAUSAL, True), ({**CAUSAL, "sampler": {"name": "top_k", "k": 3}}, True),
    ({**CAUSAL, "sampler": {"name": "mirostat", "tau": 2.0}}, False),
    ({**CAUSAL, "sampler": {"name": "top_p", "p": 0.9, "masking": "learned"}}, True),
    ({**CAUSAL, "algorithm": "ppo_pp", "guide": {"callable": "tests.test_guided:count_up_guide"}}, True),
    (SEQ2SEQ, False)])
def test_greedy_decode_blocks_give_the_episodes_of_one_step_per_round_trip(raw, captured, monkeypatch):
    """Evaluation (`explore=False`) in decode blocks (4 steps per env round trip, the default): the
    same episodes, token for token, as one step per round trip, log-probs equal; each token the
    argmax of an uncached pass (masked by a stateless sampler). For the decode engine's static
    greedy step (its blocks one captured graph, as on a GPU), a masking sampler, a stateful one
    (mirostat: step by step inside the block), NLPO's learned mask (likewise), a guided policy
    (greedy steps take no guide token) and a seq2seq policy."""
    one, single, _ = greedy_episodes(raw, 1, captured, monkeypatch)
    four, blocks, graphs = greedy_episodes(raw, 4, captured, monkeypatch)
    assert not single and blocks and set(blocks) == {(4, False)}
    assert len(four) == len(one) == 24
    for (prompt, actions, logp), (prompt4, actions4, logp4) in zip(one, four):
        assert prompt4 == prompt and actions4 == actions
        np.testing.assert_allclose(logp4, logp, atol=1e-6)
    if captured and graphs is not None:  # the greedy step and its blocks' later steps replayed as graphs
        from agents.modules.acting import GREEDY_KEY

        assert GREEDY_KEY in graphs and ("steps", 3, GREEDY_KEY) in graphs


def test_act_steps_equals_act_called_on_the_windows_the_env_would_give():
    """A block of module steps draws the same tokens, log-probs and values as one `act` per step on
    the windows shifted on the host (same generator state), for a causal and a seq2seq policy and
    a stateful sampler (mirostat: its per-row state carries on through the block)."""
    from ray.rllib.core.columns import Columns

    from agents.core import ROW_CONTINUES

    for raw in (CAUSAL, SEQ2SEQ, {**CAUSAL, "sampler": {"name": "mirostat", "tau": 2.0}}):
        runner = FastTokenEnvRunner(config=algorithm_config(validate(raw)))
        module = runner.module
        env = runner.env.unwrapped
        obs, _ = env.reset(seed=3)
        batch = {Columns.OBS: {k: torch.as_tensor(v) for k, v in obs.items()},
                 ROW_CONTINUES: torch.zeros(env.num_envs, dtype=torch.bool)}
        generator = module.rollout_generator(torch.device("cpu"))
        start = generator.get_state()
        module.weights_changed()
        block = module.act_steps(batch, 3)
        generator.set_state(start)
        module.weights_changed()
        window = {k: torch.as_tensor(v) for k, v in obs.items()}
        for j in range(3):
            out = module.act({Columns.OBS: window, ROW_CONTINUES: torch.full((env.num_envs,), j > 0)})
            for key, value in out.items():
                assert torch.allclose(block[key][j].float(), value.float(), atol=1e-6), (raw["model"], j, key)
            token = out[Columns.ACTIONS][:, None]
            window = {**window, "input_ids": torch.cat([window["input_ids"][:, 1:], token], 1),
                      "attention_mask": torch.cat([window["attention_mask"][:, 1:],
                                                   torch.ones_like(token)], 1)}
        runner.stop()


def test_decode_block_unset_is_four_on_the_cpu_too_and_one_steps_a_token_per_round_trip():
    from agents.env_runner import runner_decode_block

    assert validate(CAUSAL)["env_runners"]["decode_block"] is None
    for setting, expected in ((None, {4}), (1, set())):
        raw = CAUSAL if setting is None else {**CAUSAL,
                                              "env_runners": {**CAUSAL["env_runners"], "decode_block": setting}}
        runner = FastTokenEnvRunner(config=algorithm_config(validate(raw)))
        blocks, act_steps = [], runner.module.act_steps
        runner.module.act_steps = lambda batch, steps, explore=True: blocks.append(steps) or act_steps(
            batch, steps, explore)
        runner.sample()
        assert set(blocks) == expected and runner_decode_block(runner) == (setting or 4)
        runner.stop()


def test_decode_block_with_the_stock_runner_is_refused_in_one_line():
    from agents.config import ConfigError

    with pytest.raises(ConfigError) as err:
        validate({**CAUSAL, "env_runners": {**CAUSAL["env_runners"], "runner": "stock", "decode_block": 2}})
    assert str(err.value).startswith("env_runners.decode_block: only the fast runner steps in blocks")


def test_finished_episodes_are_built_while_the_next_block_runs():
    """With decode blocks, a row's finished episode is built after the module's next block is
    queued and before its outputs are read (on a GPU the host builds episodes while the device
    computes), the rest at the call's end; each episode keeps its own prompt, reset info and last
    observation, though its row restarted on another prompt before it was built."""
    raw = {**CAUSAL, "env_runners": {**CAUSAL["env_runners"], "decode_block": 4}}
    runner = FastTokenEnvRunner(config=algorithm_config(validate(raw)))
    events = []
    module, host, episode = runner.module, runner._host, runner._episode
    act_steps, to_host = module.act_steps, host.to_host
    module.act_steps = lambda *a, **k: (events.append("queued"), act_steps(*a, **k))[1]
    host.to_host = lambda *a, **k: (events.append("read"), to_host(*a, **k))[1]
    runner._episode = lambda *a, **k: (events.append("episode"), episode(*a, **k))[1]
    episodes = runner.sample()
    assert events.count("episode") == len(episodes) > 8  # more episodes than rows: rows restarted
    last_read = len(events) - 1 - events[::-1].index("read")
    for j, event in enumerate(events[:last_read]):
        if event == "episode":  # between a block's queueing and the reading of its outputs
            before = [e for e in events[:j] if e != "episode"]
            after = next(e for e in events[j:] if e != "episode")
            assert before[-1] == "queued" and after == "read", events
    assert "episode" in events[:last_read]
    tok = runner.env.unwrapped.tokenizer
    for e in episodes:
        first, last = e.get_observations(0), e.get_observations(-1)
        prompt = tok.decode(first["input_ids"][first["attention_mask"] == 1], skip_special_tokens=True)
        assert e.get_infos(0)["prompt"] == e.get_infos(-1)["prompt"] == prompt
        assert (last["input_ids"][-len(e):] == e.get_actions()).all()
        assert e.get_infos(-1)["generation"] == tok.decode(e.get_actions(), skip_special_tokens=True)
    runner.stop()
