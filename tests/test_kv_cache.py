"""The cached rollout path gives the uncached logits, whatever the envs do."""
import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns

from agents.modules import CausalLMActorCritic
from env.text_env import TokenGenerationEnv

ENV_CFG = {"task": {"name": "increasing_numbers", "num_numbers": 10}, "max_prompt_len": 4, "max_new_tokens": 6}


def module(kv_cache):
    env = TokenGenerationEnv(ENV_CFG)
    m = CausalLMActorCritic(
        observation_space=env.observation_space, action_space=env.action_space, inference_only=True,
        model_config={"model": {"name_or_path": "tiny-gpt2", "kv_cache": kv_cache}, "env": ENV_CFG, "seed": 0},
    ).eval()
    assert (m.kv_cache is not None) == kv_cache  # the uncached reference really is uncached
    return m


def test_cached_equals_uncached_across_resets_restarts_and_partial_autoresets():
    cached, plain = module(True), module(False)
    envs = [TokenGenerationEnv(ENV_CFG) for _ in range(4)]
    rng = np.random.default_rng(0)
    obs = [e.reset(seed=i, options={"prompt": ["1", "2 3", "4 5 6 7", "8"][i]})[0] for i, e in enumerate(envs)]
    steps = 0
    for t in range(40):
        batch = {Columns.OBS: {k: torch.as_tensor(np.stack([o[k] for o in obs])) for k in obs[0]}}
        a = cached.forward_inference(batch)[Columns.ACTION_DIST_INPUTS]
        b = plain.forward_inference(batch)[Columns.ACTION_DIST_INPUTS]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        steps += 1
        for i, e in enumerate(envs):
            if t == 13 and i == 2:  # restart one row to an arbitrary state mid-episode
                obs[i] = e.reset(options={"prompt": "9 9", "prefix_ids": [5, 6, 7]})[0]
                continue
            # EOS now and then: that row's env auto-resets while the others continue.
            action = 1 if rng.random() < 0.1 else int(rng.integers(2, 12))
            o, _, done, _, _ = e.step(action)
            obs[i] = e.reset(seed=100 + t)[0] if done else o
    stats = cached.kv_cache.stats
    assert stats["incremental_rows"] > 2 * stats["prefill_rows"]  # the cache was actually used
    assert cached.kv_cache.engine is not None  # a GPT-2 policy's steps ran in the decode engine's ring


def test_weight_sync_invalidates_the_cache():
    cached = module(True)
    env = TokenGenerationEnv(ENV_CFG)
    o, _ = env.reset(seed=0)
    batch = lambda o: {Columns.OBS: {k: torch.as_tensor(v)[None] for k, v in o.items()}}  # noqa: E731
    cached.forward_inference(batch(o))
    o, *_ = env.step(5)
    # New weights arrive between two steps of the same episode.
    state = {k: v * 1.5 if v.dtype.kind == "f" else v for k, v in cached.get_state().items()}
    cached.set_state(state)
    got = cached.forward_inference(batch(o))[Columns.ACTION_DIST_INPUTS]
    fresh = module(False)
    fresh.set_state(state)
    want = fresh.forward_inference(batch(o))[Columns.ACTION_DIST_INPUTS]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_seeded_ppo_reward_curve_is_the_same_with_and_without_the_cache(ray_local):
    """The cache changes speed, not training: the same seed gives the same curve."""
    from agents.config import algorithm_config, load
    from tests.conftest import QUICKSTART

    curves = {}
    for kv in (True, False):
        cfg = load(QUICKSTART, [f"model.kv_cache={str(kv).lower()}", "training.train_batch_size=512",
                                "training.minibatch_size=128", "env_runners.num_envs_per_env_runner=8"])
        algo = algorithm_config(cfg).build_algo()
        try:
            assert (algo.env_runner_group.local_env_runner.module.kv_cache is not None) == kv
            curves[kv] = [
                (r["env_runners"]["episode_return_mean"], r["env_runners"]["num_env_steps_sampled_lifetime"])
                for r in (algo.train() for _ in range(8))
            ]
        finally:
            algo.stop()
    cached, plain = np.array(curves[True]), np.array(curves[False])
    # Logits agree to float tolerance, so seeded sampling draws the same tokens
    # except on a near-tie; allow a small drift, never a different trend.
    np.testing.assert_allclose(cached[:, 0], plain[:, 0], atol=0.03)
    assert cached[-1, 0] > cached[0, 0] + 0.05  # both runs learned, by the same amount


def test_a_window_prefilled_before_is_reused_and_gives_the_uncached_logits():
    cached, plain = module(True), module(False)
    envs = [TokenGenerationEnv(ENV_CFG) for _ in range(4)]
    obs = [e.reset(seed=i, options={"prompt": p})[0] for i, (e, p) in enumerate(zip(envs, ["1", "2 3", "1", "4"]))]

    def call():
        batch = {Columns.OBS: {k: torch.as_tensor(np.stack([o[k] for o in obs])) for k in obs[0]}}
        torch.testing.assert_close(cached.forward_inference(batch)[Columns.ACTION_DIST_INPUTS],
                                   plain.forward_inference(batch)[Columns.ACTION_DIST_INPUTS], atol=1e-5, rtol=1e-5)

    stats = cached.kv_cache.stats
    call()  # rows 0 and 2 start on the same window: 3 distinct windows computed for 4 rows
    assert (stats["prefill_rows"], stats["prefill_computed_rows"]) == (4, 3)
    for action in (5, 6):
        obs = [e.step(action)[0] for e in envs]
        call()
    obs[0], obs[2] = envs[0].step(7)[0], envs[2].step(7)[0]
    obs[1] = envs[1].reset(options={"prompt": "1"})[0]  # seen before: reused
    obs[3] = envs[3].reset(options={"prompt": "5"})[0]  # new: computed
    call()
    assert (stats["prefill_rows"], stats["prefill_computed_rows"]) == (6, 4)  # 2 rows started, 1 computed
    obs[:3] = [e.step(8)[0] for e in envs[:3]]
    obs[3] = envs[3].reset(options={"prompt": "2 3"})[0]
    call()
    assert (stats["prefill_rows"], stats["prefill_computed_rows"]) == (7, 4)  # the row that started reused its prefill
    cached.set_state(cached.get_state())  # new weights: no stored prefill is valid any more
    call()  # every row again; rows 0 and 2 still hold one window between them
    assert (stats["prefill_rows"], stats["prefill_computed_rows"]) == (7 + 4, 4 + 3)


def test_prefill_store_stays_within_its_bytes_dropping_the_least_recently_used():
    from agents.modules.kv_cache import PrefillStore

    entry = lambda: (torch.zeros(4), torch.zeros(2, 1, 2, 3))  # noqa: E731  (16 + 48 bytes: keys and values of one layer)
    store = PrefillStore(max_bytes=3 * 64)
    for key in (b"a", b"b", b"c"):
        store.put(key, entry())
    assert store.get(b"a") is not None  # now the most recently used
    store.put(b"d", entry())
    assert store.bytes <= 3 * 64 and set(store.entries) == {b"a", b"c", b"d"}
    PrefillStore(max_bytes=10).put(b"x", entry())  # larger than the whole store: not kept
    store.clear()
    assert store.bytes == 0 and not store.entries


def _gpt2_trunk(**config):
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    return GPT2Model(GPT2Config(vocab_size=30, n_positions=32, n_layer=2, n_head=4, n_embd=32, **config)).eval()


def _window_cache(trunk, B=5, L=9):
    """A left-padded window batch (rows of different lengths) and the cache of the window before it."""
    from agents.modules.kv_cache import cache_from_layers, prefill_pass

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 30, (B, L), generator=g)
    mask = torch.zeros(B, L, dtype=torch.long)
    for r, n in enumerate(torch.randint(2, L + 1, (B,), generator=g).tolist()):
        mask[r, L - n:] = 1
    prev_ids = torch.cat([torch.zeros(B, 1, dtype=torch.long), ids[:, :-1]], 1)
    prev_mask = torch.cat([torch.zeros(B, 1, dtype=torch.long), mask[:, :-1]], 1)
    _, layers = prefill_pass(trunk, prev_ids, prev_mask)
    return ids, mask, lambda: cache_from_layers(trunk.config, [(k.clone(), v.clone()) for k, v in layers])


@torch.no_grad()
def test_gpt2_step_as_tensor_ops_gives_transformers_step_and_cache():
    from agents.modules.kv_cache import _transformers_step, gpt2_step

    trunk = _gpt2_trunk()
    ids, mask, past = _window_cache(trunk)
    want_past, got_past = past(), past()
    want = _transformers_step(trunk, want_past, ids, mask, mask_4d=False)
    got = gpt2_step(trunk)(got_past, ids, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_past.layers, want_past.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    # ... and the whole window's uncached pass agrees at every row's newest token
    full = trunk(input_ids=ids, attention_mask=mask,
                 position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state[:, -1]
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


def test_gpt2_step_is_refused_where_it_would_differ_from_transformers():
    from peft import LoraConfig, get_peft_model

    from agents.modules.kv_cache import gpt2_step

    assert gpt2_step(_gpt2_trunk()) is not None
    assert gpt2_step(_gpt2_trunk(reorder_and_upcast_attn=True)) is None
    assert gpt2_step(_gpt2_trunk(scale_attn_by_inverse_layer_idx=True)) is None
    hooked = _gpt2_trunk()
    hooked.h[1].mlp.register_forward_hook(lambda *a: None)
    assert gpt2_step(hooked) is None
    lora = get_peft_model(_gpt2_trunk(), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    assert gpt2_step(lora.base_model.model) is None  # the projections are adapters now


@torch.no_grad()
def test_cache_keeps_transformers_step_when_the_tensor_op_step_differs():
    from agents.modules.kv_cache import WindowKVCache

    trunk = _gpt2_trunk()
    ids, mask, past = _window_cache(trunk)
    cache = WindowKVCache()
    broken = lambda past, ids, mask: torch.zeros(ids.shape[0], 32)  # noqa: E731
    import agents.modules.kv_cache as kv

    original = kv.gpt2_step
    kv.gpt2_step = lambda trunk: broken
    try:
        hidden = cache._step(trunk, past(), ids, mask)
    finally:
        kv.gpt2_step = original
    assert cache.lean_step is False
    want = kv._transformers_step(trunk, past(), ids, mask, mask_4d=False)
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)


def test_gpt2_forward_as_tensor_ops_gives_transformers_states_caches_and_gradients():
    """The learner's and the prefill's pass over whole left-padded windows: same hidden states at
    every real token, same keys/values, and the same weight gradients as transformers' forward."""
    from agents.modules.kv_cache import _LEAN_FORWARD_CHECKED, gpt2_forward, lean_forward, position_ids_for

    trunk = _gpt2_trunk(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    ids, mask, _ = _window_cache(trunk)
    real = mask.bool()

    def grads(hidden):
        trunk.zero_grad()
        (hidden[real] ** 2).sum().backward()
        return {n: p.grad.clone() for n, p in trunk.named_parameters() if p.grad is not None}

    want = trunk(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=True)
    want_grads = grads(want.last_hidden_state)
    got, layers = gpt2_forward(trunk, ids, mask, keys_values=True)
    torch.testing.assert_close(got[real], want.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    for (k, v), layer in zip(layers, want.past_key_values.layers):
        torch.testing.assert_close(k.transpose(1, 2)[real], layer.keys.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v.transpose(1, 2)[real], layer.values.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
    got_grads = grads(gpt2_forward(trunk, ids, mask)[0])
    assert got_grads.keys() == want_grads.keys() and len(got_grads) == len(list(trunk.parameters()))
    for name in want_grads:  # float32 rounding of a different attention kernel, on the gradient's scale
        scale = max(1.0, want_grads[name].abs().max().item())
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=3e-5 * scale, rtol=1e-4, msg=name)
    # lean_forward checks it once per trunk and then takes it
    hidden, _ = lean_forward(trunk, ids, mask)
    assert _LEAN_FORWARD_CHECKED[trunk] is True
    torch.testing.assert_close(hidden[real], want.last_hidden_state[real], atol=1e-5, rtol=1e-5)


def test_gpt2_forward_is_refused_where_it_would_differ_from_transformers():
    from agents.modules.kv_cache import _LEAN_FORWARD_CHECKED, gpt2_forward, lean_forward

    trunk = _gpt2_trunk()  # GPT-2's default dropout 0.1
    ids, mask, _ = _window_cache(trunk)
    assert gpt2_forward(trunk, ids, mask) is not None  # eval mode: no dropout
    assert gpt2_forward(trunk.train(), ids, mask) is None  # training with dropout: transformers' forward
    plain = _gpt2_trunk(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    plain.gradient_checkpointing_enable()  # recomputes activations per block: transformers' forward
    assert gpt2_forward(plain, ids, mask) is None
    with torch.autocast("cpu", dtype=torch.float16):  # fp16's mask would overflow in the matmuls
        assert gpt2_forward(_gpt2_trunk().eval(), ids, mask) is None
    assert gpt2_forward(_gpt2_trunk(reorder_and_upcast_attn=True), ids, mask) is None
    # a pass that differed from transformers' on the first batch is never taken for that trunk
    import agents.modules.kv_cache as kv

    trunk = _gpt2_trunk().eval()
    original = kv.gpt2_forward
    kv.gpt2_forward = lambda trunk, ids, mask, keys_values=False: (torch.zeros(*ids.shape, 32), [])
    try:
        hidden, _ = lean_forward(trunk, ids, mask)
    finally:
        kv.gpt2_forward = original
    assert _LEAN_FORWARD_CHECKED[trunk] is False
    want = trunk(input_ids=ids, attention_mask=mask, position_ids=kv.position_ids_for(mask)).last_hidden_state
    torch.testing.assert_close(hidden, want)
    assert lean_forward(trunk, ids, mask)[0].abs().sum() > 0  # and stays with transformers' forward


@pytest.mark.parametrize("attention", ["matmuls", "fused"])
def test_gpt2_forward_under_bf16_autocast_gives_transformers_pass_and_gradients(attention, monkeypatch):
    """The learner's passes on a GPU run under bf16 autocast: there the tensor-op pass is taken
    too, and its hidden states and parameter gradients are transformers' under the same autocast,
    within bf16's rounding; by batched matmuls (short CPU windows) and by PyTorch's fused
    attention (what a GPU's learner pass takes), padding rows included (no NaN)."""
    import agents.modules.kv_cache as kv
    from agents.modules.kv_cache import _LEAN_FORWARD_CHECKED, gpt2_forward, lean_forward, position_ids_for

    if attention == "fused":
        monkeypatch.setattr(kv, "MATMUL_ATTENTION_MAX_COLUMNS", 0)

    trunk = _gpt2_trunk(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    ids, mask, _ = _window_cache(trunk)
    real = mask.bool()

    def pass_and_grads(fn):
        trunk.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = fn()
        (hidden[real].float() ** 2).mean().backward()
        return hidden.detach().float(), {n: p.grad.clone() for n, p in trunk.named_parameters()}

    lean, lean_grads = pass_and_grads(lambda: gpt2_forward(trunk, ids, mask)[0])
    ref, ref_grads = pass_and_grads(lambda: trunk(input_ids=ids, attention_mask=mask,
                                                  position_ids=position_ids_for(mask)).last_hidden_state)
    assert lean.dtype == ref.dtype  # both float32 out of the final layer norm
    assert not lean.isnan().any() and not any(g.isnan().any() for g in lean_grads.values())
    torch.testing.assert_close(lean[real], ref[real], atol=3e-2, rtol=3e-2)
    for name, grad in ref_grads.items():
        scale = grad.abs().max().clamp_min(1e-6)
        assert (lean_grads[name] - grad).abs().max() / scale < 5e-2, name
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean_forward(trunk, ids, mask)
    assert _LEAN_FORWARD_CHECKED[trunk] is True  # the once-per-trunk check took the tensor-op pass


def test_fused_gelu_gives_gpt2s_gelu_new():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.activations import NewGELUActivation

    from agents.model_edits import TanhGELU, fuse_activations

    torch.manual_seed(0)
    plain = GPT2LMHeadModel(GPT2Config(vocab_size=30, n_positions=16, n_layer=2, n_head=2, n_embd=16)).eval()
    fused = GPT2LMHeadModel(plain.config).eval()
    fused.load_state_dict(plain.state_dict())
    fuse_activations(fused)
    assert not any(isinstance(m, NewGELUActivation) for m in fused.modules())
    assert sum(isinstance(m, TanhGELU) for m in fused.modules()) == 2
    x = torch.randint(0, 30, (3, 10))
    torch.testing.assert_close(fused(x).logits, plain(x).logits, atol=1e-5, rtol=1e-5)
    assert fused.config.activation_function == "gelu_new"  # a saved model loads as before


def test_window_attention_by_batched_matmuls_equals_fused_attention():
    """CPU passes over short windows attend by two batched matmuls: the fused op's result at
    every query that has a key to attend to; long windows keep the fused op (its memory does not
    grow with queries x columns), one-query steps the matmuls at any length."""
    import torch.nn.functional as F

    from agents.modules.kv_cache import MATMUL_ATTENTION_MAX_COLUMNS, attention_mask_per_head, window_attention

    g = torch.Generator().manual_seed(0)
    B, H, T, hd = 3, 2, 9, 4
    q, k, v = (torch.randn(B, H, T, hd, generator=g) for _ in range(3))
    real = torch.ones(B, T, dtype=torch.bool)
    real[0, :4] = real[1, :1] = False  # left padding
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None] & real[:, None, :]
    mask = torch.zeros(B, 1, T, T).masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    per_head = attention_mask_per_head(mask, H)
    assert per_head.shape == (B * H, T, T)
    got, want = window_attention(q, k, v, per_head), F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got.transpose(1, 2)[real], want.transpose(1, 2)[real], atol=1e-6, rtol=1e-5)
    long = MATMUL_ATTENTION_MAX_COLUMNS + 1
    assert attention_mask_per_head(torch.zeros(1, 1, long, long), H).dim() == 4
    assert attention_mask_per_head(torch.zeros(1, 1, 1, long), H).shape == (H, 1, long)
    # fp16 passes keep the fused op: its padding query rows would be NaN through the matmuls
    half = torch.zeros(B, 1, T, T, dtype=torch.float16).masked_fill_(~allowed[:, None], torch.finfo(torch.float16).min)
    assert attention_mask_per_head(half, H).dim() == 4
    out = window_attention(*(x.half() * 8 for x in (q, k, v)), attention_mask_per_head(half, H))
    assert torch.isfinite(out).all()
    assert attention_mask_per_head(half[:, :, -1:], H).shape == (B * H, 1, T)  # a step: the matmuls
