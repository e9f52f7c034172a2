"""The batched token env against its reference: `TokenGenerationVectorEnv` and a `SyncVectorEnv` of
`TokenGenerationEnv` rows (or `RepeatedPromptEnv` rows), stepped with the same random actions, return
the same observations, rewards, terminations, truncations and infos at every step, through resets,
restarts and both autoresets; DISABLED rows wait for their reset; RLlib's stock EnvRunner samples
whole episodes from it."""
import copy

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

from env.text_env import RepeatedPromptEnv
from agents.config import algorithm_config, env_config, validate
from agents.env_runner import make_token_env
from env.text_env import TokenGenerationEnv
from env.vector_env import TokenGenerationVectorEnv

B = 4
INCREASING = {"task": {"name": "increasing_numbers", "num_numbers": 10, "prompt_len": 3},
              "max_prompt_len": 4, "max_new_tokens": 5}
SORT = {"task": {"name": "sort_numbers", "num_numbers": 10, "length": 4, "num_train": 50, "num_eval": 5},
        "max_prompt_len": 4, "max_new_tokens": 5}
CASES = {
    "increasing-sparse": (INCREASING, {"prompt": "3 4"}),
    "increasing-dense": ({**INCREASING, "dense_reward": True}, {"prompt": "3 4"}),
    "sort-seq2seq": ({**SORT, "encoder_decoder": True}, {"prompt": "3 1 2 0", "meta": {"references": ["0 1 2 3"]}}),
}
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]


def sync_ref(cfg, mode=AutoresetMode.NEXT_STEP, row_cls=TokenGenerationEnv):
    return SyncVectorEnv([lambda: row_cls(cfg) for _ in range(B)], autoreset_mode=mode)


def ids(env, *words):
    return [env.tokenizer.convert_tokens_to_ids(w) for w in words]


def random_actions(rng, env, eos_prob=0.25):
    """Uniform tokens (pad and EOS included), EOS more often so that episodes also end early."""
    actions = rng.integers(env.vocab_size, size=env.num_envs)
    return np.where(rng.random(env.num_envs) < eos_prob, env.eos_id, actions)


def per_row(infos, n=B):
    """Gymnasium's vector infos as one dict per row, nested dicts of arrays read as DictInfoToList does."""
    rows = [{} for _ in range(n)]
    for key, value in infos.items():
        if key.startswith("_"):
            continue
        values = per_row(value, n) if isinstance(value, dict) else list(value)
        for i in np.flatnonzero(infos["_" + key]):
            rows[i][key] = values[i]
    return rows


def assert_same(got, want, where):
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: {got!r} != {want!r}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, f"{where}: {got!r} != {want!r}"
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def assert_obs_equal(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def assert_infos_equal(got, want):
    """Same keys, same `_key` masks and dtypes, same value in every row that has the key."""
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, np.ndarray) and isinstance(got[k], np.ndarray):
            assert got[k].dtype == v.dtype, k
    for g, w, i in zip(per_row(got), per_row(want), range(B)):
        assert_same(g, w, f"info of row {i}")


def assert_step_equal(got, want):
    obs, reward, terminated, truncated, infos = got
    assert_obs_equal(obs, want[0])
    np.testing.assert_allclose(reward, want[1], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(terminated, want[2])
    np.testing.assert_array_equal(truncated, want[3])
    assert_infos_equal(infos, want[4])


def reset_both(vec, ref, seed=None, options=None):
    """The same reset on both; the vector env's `row_options` is one reset per row of the reference."""
    obs, infos = vec.reset(seed=seed, options=copy.deepcopy(options))
    options = copy.deepcopy(options or {})
    row_options = options.pop("row_options", None)
    if row_options is None:
        want_obs, want_infos = ref.reset(seed=seed, options=options)  # (SyncVectorEnv pops the mask)
        assert_obs_equal(obs, want_obs)
        assert_infos_equal(infos, want_infos)
        return obs, infos
    want_rows = [{} for _ in range(B)]
    for i in np.flatnonzero(options.pop("reset_mask", np.ones(B, dtype=bool))):
        one = np.arange(B) == i
        opts = row_options[i] if row_options[i] is not None else options
        want_obs, row_infos = ref.reset(seed=seed, options={**opts, "reset_mask": one})
        want_rows[i] = per_row(row_infos)[i]
    assert_obs_equal(obs, want_obs)
    for i, (g, w) in enumerate(zip(per_row(infos), want_rows)):
        assert_same(g, w, f"reset info of row {i}")
    return obs, infos


def run_both(vec, ref, rng, steps, events=(), eos_prob=0.25):
    """Steps both with the same random actions and compares all they return; `events` holds
    (step, reset kwargs) applied to both before that step. Returns how the episodes went."""
    events = dict(events)
    seen = {"eos": 0, "horizon": 0, "dense": 0}
    for t in range(steps):
        if t in events:
            reset_both(vec, ref, **events[t])
        actions = random_actions(rng, vec, eos_prob)
        got, want = vec.step(actions), ref.step(actions)
        assert_step_equal(got, want)
        terminated, reward = want[2], want[1]
        seen["eos"] += int((terminated & (actions == vec.eos_id)).sum())
        seen["horizon"] += int((terminated & (actions != vec.eos_id)).sum())
        seen["dense"] += int(((reward != 0) & ~terminated).sum())
    return seen


def test_spaces_and_autoreset_mode_are_those_of_sync_vector_env():
    vec = TokenGenerationVectorEnv(CASES["sort-seq2seq"][0], B, autoreset_mode=AutoresetMode.SAME_STEP)
    ref = sync_ref(CASES["sort-seq2seq"][0], AutoresetMode.SAME_STEP)
    assert vec.num_envs == B
    assert vec.single_observation_space == ref.single_observation_space
    assert vec.observation_space == ref.observation_space
    assert vec.single_action_space == ref.single_action_space and vec.action_space == ref.action_space
    assert vec.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    assert TokenGenerationVectorEnv(INCREASING, B).metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("case", list(CASES))
def test_steps_match_sync_vector_env_through_resets_and_restarts(case, mode):
    cfg, restart = CASES[case]
    vec, ref = TokenGenerationVectorEnv(cfg, B, autoreset_mode=mode), sync_ref(cfg, mode)
    rng = np.random.default_rng(0)
    obs, _ = reset_both(vec, ref, seed=11)  # row i seeded with 11 + i, as SyncVectorEnv does
    if vec.encoder_decoder:
        assert len({tuple(r) for r in obs["encoder_input_ids"]}) == B  # four rows, four seeds, four prompts
    prefix = ids(vec, "1", "2")
    events = [
        (20, {"options": {"reset_mask": np.array([True, False, True, False])}}),
        (35, {"options": {**restart, "prefix_ids": prefix}}),  # a restart, the same for every row
        (50, {"options": {"row_options": [{**restart, "prefix_ids": prefix[:1]}, None, None,
                                          {**restart, "prefix_ids": prefix}]}}),
        (65, {"seed": 5, "options": {"reset_mask": np.array([False, True, True, True])}}),
    ]
    seen = run_both(vec, ref, rng, 90, events)
    assert seen["eos"] > 0 and seen["horizon"] > 0  # both kinds of episode end were compared
    assert (seen["dense"] > 0) == cfg.get("dense_reward", False)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_an_unscored_episode_pays_nothing_and_the_next_one_is_scored(mode):
    cfg = {**INCREASING, "dense_reward": True}
    vec, ref = TokenGenerationVectorEnv(cfg, B, autoreset_mode=mode), sync_ref(cfg, mode)
    reset_both(vec, ref, seed=0, options={"prompt": "3 4", "score": False})
    ascending = ids(vec, "1", "2", "3", "4", "5")  # worth 1.0 when scored, paid step by step (dense)

    def step(action):
        got, want = vec.step(np.full(B, action)), ref.step(np.full(B, action))
        assert_step_equal(got, want)
        return got

    unscored = [step(a) for a in ascending]
    assert unscored[-1][2].all() and all((r == 0).all() for _, r, *_ in unscored)
    if mode == AutoresetMode.NEXT_STEP:  # the step that resets the rows
        assert "prompt" in step(vec.eos_id)[4]
    scored = [step(a) for a in ascending]  # autoreset episodes take no options: scored
    assert scored[-1][2].all()
    np.testing.assert_allclose(np.sum([r for _, r, *_ in scored], axis=0), 1.0)
    assert (scored[1][1] > 0).all()


def test_disabled_rows_wait_as_they_are_until_a_reset_mask_restarts_them():
    cfg = {**SORT, "dense_reward": True}
    vec = TokenGenerationVectorEnv(cfg, B, autoreset_mode=AutoresetMode.DISABLED)
    rows = [TokenGenerationEnv(cfg) for _ in range(B)]
    obs, _ = vec.reset(seed=3)
    for i, row in enumerate(rows):
        row_obs, _ = row.reset(seed=3 + i)
        assert_obs_equal({k: v[i] for k, v in obs.items()}, row_obs)
    rng = np.random.default_rng(1)
    waiting = np.zeros(B, dtype=bool)
    waited = restarts = 0
    for _ in range(80):
        if waiting.sum() >= 2:  # restart the waiting rows: their row streams go on, seeded above
            obs, infos = vec.reset(options={"reset_mask": waiting.copy()})
            for i in np.flatnonzero(waiting):
                row_obs, row_info = rows[i].reset()
                assert_obs_equal({k: v[i] for k, v in obs.items()}, row_obs)
                assert per_row(infos)[i] == row_info
            assert all(per_row(infos)[i] == {} for i in np.flatnonzero(~waiting))
            restarts += 1
            waiting[:] = False
        before = obs
        np.testing.assert_array_equal(vec.done, waiting)
        actions = random_actions(rng, vec)
        obs, reward, terminated, truncated, infos = vec.step(actions)
        assert not truncated.any()
        for i in range(B):
            if waiting[i]:  # as it was: same window, no reward, no info
                assert_obs_equal({k: v[i] for k, v in obs.items()}, {k: v[i] for k, v in before.items()})
                assert reward[i] == 0 and per_row(infos)[i] == {}
                waited += 1
                continue
            row_obs, row_reward, row_term, _, row_info = rows[i].step(actions[i])
            assert_obs_equal({k: v[i] for k, v in obs.items()}, row_obs)
            assert reward[i] == pytest.approx(row_reward, abs=1e-12)
            assert terminated[i] == row_term
            assert per_row(infos)[i] == row_info  # (numpy scalars in the vector infos)
            waiting[i] = row_term
    assert waited > 0 and restarts > 0


def test_disabled_rows_that_wait_report_terminated():
    vec = TokenGenerationVectorEnv(INCREASING, B, autoreset_mode=AutoresetMode.DISABLED)
    vec.reset(seed=0)
    one = ids(vec, "1")[0]
    _, _, terminated, _, _ = vec.step(np.array([vec.eos_id, one, one, one]))
    assert terminated.tolist() == [True, False, False, False]
    _, reward, terminated, _, _ = vec.step(np.array([one, one, one, one]))
    assert reward[0] == 0 and vec.done[0]
    assert terminated[0]  # "terminated True" while it waits for reset_mask


@pytest.mark.parametrize("bad", [-1, "vocab_size"])
def test_an_action_outside_the_vocabulary_raises_and_changes_nothing(bad):
    vec, ref = TokenGenerationVectorEnv(INCREASING, B), sync_ref(INCREASING)
    reset_both(vec, ref, seed=0)
    actions = np.full(B, ids(vec, "1")[0])
    bad_actions = actions.copy()
    bad_actions[2] = vec.vocab_size if bad == "vocab_size" else bad
    with pytest.raises(ValueError, match=rf"action {bad_actions[2]} outside \[0, {vec.vocab_size}\)"):
        vec.step(bad_actions)
    assert_step_equal(vec.step(actions), ref.step(actions))  # the failed step left no trace


@pytest.mark.parametrize("shape", [(B + 1,), (B - 1,), (1, B)])
def test_a_reset_mask_of_the_wrong_shape_raises(shape):
    vec = TokenGenerationVectorEnv(INCREASING, B)
    with pytest.raises(ValueError, match=rf"reset_mask must have shape \({B},\)"):
        vec.reset(options={"reset_mask": np.ones(shape, dtype=bool)})


def test_repeated_prompt_rows_match_sync_vector_env_of_them():
    cfg = {**SORT, "repeat_prompt": 3}
    vec = TokenGenerationVectorEnv(cfg, B, row_env_cls=RepeatedPromptEnv)
    ref = sync_ref(cfg, row_cls=RepeatedPromptEnv)
    assert all(type(r) is RepeatedPromptEnv and r.repeat == 3 for r in vec.rows)
    _, infos = reset_both(vec, ref, seed=0)
    prompts = [[p] for p in infos["prompt"]]
    rng = np.random.default_rng(2)
    for _ in range(60):
        actions = random_actions(rng, vec, eos_prob=0.4)
        got, want = vec.step(actions), ref.step(actions)
        assert_step_equal(got, want)
        for i, info in enumerate(per_row(got[4])):
            if "prompt_truncated" in info:  # an autoreset
                prompts[i].append(info["prompt"])
                assert info["meta"]["references"]
    for row in prompts:  # each row draws its prompts in groups of three, from reset(seed=0) on
        assert len(row) >= 9 and len(set(row)) > 1
        assert all(len(set(row[k:k + 3])) == 1 for k in range(0, len(row), 3))


@pytest.mark.parametrize("key", ["final_info", "meta"])
def test_dict_valued_infos_have_gymnasiums_nested_layout(key):
    if key == "final_info":  # SAME_STEP: the finished rows' last step infos
        cfg, mode, row_cls = INCREASING, AutoresetMode.SAME_STEP, TokenGenerationEnv
    else:  # RepeatedPromptEnv's reset info
        cfg, mode, row_cls = {**SORT, "repeat_prompt": 2}, AutoresetMode.NEXT_STEP, RepeatedPromptEnv
    vec = TokenGenerationVectorEnv(cfg, B, autoreset_mode=mode, row_env_cls=row_cls)
    ref = sync_ref(cfg, mode, row_cls)
    got, want = vec.reset(seed=0)[1], ref.reset(seed=0)[1]
    if key == "final_info":
        actions = np.array([vec.eos_id, 2, 2, vec.eos_id])
        got, want = vec.step(actions)[4], ref.step(actions)[4]
    assert isinstance(want[key], dict)
    assert isinstance(got[key], dict), type(got[key])
    assert sorted(got[key]) == sorted(want[key])


def test_make_token_env_builds_the_vector_env_when_rllib_asks_for_num_envs():
    vec = make_token_env(INCREASING | {"num_envs": B})
    assert isinstance(vec, TokenGenerationVectorEnv) and vec.num_envs == B
    assert vec.autoreset_mode == AutoresetMode.NEXT_STEP
    assert all(type(r) is TokenGenerationEnv for r in vec.rows)
    disabled = make_token_env(INCREASING | {"num_envs": 2, "autoreset_mode": "Disabled", "repeat_prompt": 3})
    assert disabled.autoreset_mode == AutoresetMode.DISABLED and disabled.num_envs == 2
    assert all(type(r) is RepeatedPromptEnv and r.repeat == 3 for r in disabled.rows)
    single = make_token_env(INCREASING | {"autoreset_mode": "Disabled"})
    assert type(single) is TokenGenerationEnv
    assert type(make_token_env(INCREASING | {"repeat_prompt": 2})) is RepeatedPromptEnv


def test_rllib_stock_env_runner_samples_complete_episodes_from_the_vector_env():
    raw = {"task": {"name": "increasing_numbers", "num_numbers": 20}, "model": {"name_or_path": "tiny-gpt2"},
           "env": {"max_prompt_len": 5, "max_new_tokens": 6}, "training": {"train_batch_size": 96, "minibatch_size": 32},
           "env_runners": {"num_envs_per_env_runner": B}}
    cfg = validate(raw)
    config = algorithm_config(cfg)
    config.env_runners(gym_env_vectorize_mode="vector_entry_point", env_runner_cls=SingleAgentEnvRunner)
    config.environment(env_config=env_config(cfg))
    config.env_config.pop("autoreset_mode", None)  # environment() merges into the fast runner's "Disabled"
    runner = SingleAgentEnvRunner(config=config)
    env = runner.env.unwrapped
    assert isinstance(env, TokenGenerationVectorEnv) and env.num_envs == B
    assert env.autoreset_mode == AutoresetMode.NEXT_STEP
    episodes = runner.sample(num_episodes=2 * B)  # more episodes than rows: rows autoreset
    assert len(episodes) >= 2 * B
    reference = TokenGenerationEnv(env_config(cfg))
    for e in episodes:
        assert e.is_done and e.is_terminated and not e.is_truncated
        obs, actions, rewards = e.get_observations(), e.get_actions(), e.get_rewards()
        ids_, mask = obs["input_ids"], obs["attention_mask"]
        assert ids_.shape == (len(e) + 1, env.seq_len)
        assert (ids_[1:, -1] == actions).all() and (ids_[1:, :-1] == ids_[:-1, 1:]).all()
        assert (mask[1:, -1] == 1).all() and (mask[1:, :-1] == mask[:-1, 1:]).all()
        assert mask[0].tolist() == [0] * 6 + [1] * 5  # the episode starts on the 5-token prompt
        assert actions[-1] == env.eos_id or len(e) == env.max_new_tokens
        assert (actions[:-1] != env.eos_id).all()
        # the reference env replays the same episode
        row_obs, _ = reference.reset()
        np.testing.assert_array_equal(row_obs["input_ids"], ids_[0])
        for t, a in enumerate(actions):
            row_obs, r, done, _, info = reference.step(a)
            np.testing.assert_array_equal(row_obs["input_ids"], ids_[t + 1])
            assert r == pytest.approx(rewards[t])
        assert done and e.get_infos(-1)["generation"] == info["generation"]
    runner.stop()


@pytest.mark.parametrize("case", ["increasing-sparse", "increasing-dense"])
def test_rewards_are_one_batched_call_per_step_with_the_per_row_values(case, monkeypatch):
    """The reward is called once per vector step, over every row that needs scoring (the rows that
    finished; every live row with dense rewards), where the per-row envs call it once per row; the
    values are the same (compared at every step by run_both)."""
    calls = []
    score = TokenGenerationEnv.score

    def counted(self, prompts, generations, metas):
        calls.append((self.__dict__.get("_vector_owner", False), len(generations)))
        return score(self, prompts, generations, metas)

    monkeypatch.setattr(TokenGenerationEnv, "score", counted)
    cfg, _ = CASES[case]
    vec, ref = TokenGenerationVectorEnv(cfg, B), sync_ref(cfg)
    vec.rows[0]._vector_owner = True  # the vector env scores through its first row's env
    reset_both(vec, ref, seed=3)
    rng = np.random.default_rng(1)
    steps_scoring, vec_rows, ref_rows = 0, 0, 0
    for _ in range(60):
        actions = random_actions(rng, vec)
        start = len(calls)
        got, want = vec.step(actions), ref.step(actions)
        assert_step_equal(got, want)
        mine = [n for owner, n in calls[start:] if owner]
        theirs = [n for owner, n in calls[start:] if not owner]
        assert len(mine) <= 1 and all(n == 1 for n in theirs)
        assert sum(mine) == len(theirs)  # the same rows scored, in one call instead of one per row
        steps_scoring += bool(mine)
        vec_rows, ref_rows = vec_rows + sum(mine), ref_rows + len(theirs)
    assert steps_scoring > 0 and vec_rows == ref_rows > steps_scoring  # some step scored several rows at once
