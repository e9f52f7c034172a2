"""The decode engine: a ring-buffer KV cache and a static step that gives the window cache's
tokens and log-probs, compiles without a graph break, and (on CUDA) replays as a CUDA graph."""
import copy

import numpy as np
import pytest
import torch

from ray.rllib.core.columns import Columns

from agents.modules import CausalLMActorCritic
from agents.modules.decode_engine import DecodeEngine, RingKVCache
from agents.core import ROW_CONTINUES
from agents.modules.kv_cache import WindowKVCache, prefill_pass
from agents.samplers import MASKED
from benchmarks.emulated_capture import capture_on_the_cpu
from env.text_env import TokenGenerationEnv

ENV_CFG = {"task": {"name": "increasing_numbers", "num_numbers": 10}, "max_prompt_len": 4, "max_new_tokens": 6}
PROMPTS = ["1", "2 3", "4 5 6 7", "8", "3", "9 2"]


def make_module(sampler=None, **model):
    env = TokenGenerationEnv(ENV_CFG)
    return CausalLMActorCritic(
        observation_space=env.observation_space, action_space=env.action_space, inference_only=True,
        model_config={"model": {"name_or_path": "tiny-gpt2", **model}, "env": ENV_CFG, "seed": 0,
                      "sampler": sampler or {"name": "none"}},
    ).eval()


def rollout(module, steps=40, seed=0, device="cpu"):
    """Explores `steps` vector steps over 6 rows (EOS and restarts as the fast EnvRunner has them:
    a finished row restarts at once, ROW_CONTINUES on the CPU); returns actions and log-probs."""
    envs = [TokenGenerationEnv(ENV_CFG) for _ in PROMPTS]
    obs = [e.reset(seed=i, options={"prompt": p})[0] for i, (e, p) in enumerate(zip(envs, PROMPTS))]
    cont = np.zeros(len(envs), dtype=bool)
    torch.manual_seed(seed)
    actions, logps = [], []
    for t in range(steps):
        batch = {Columns.OBS: {k: torch.as_tensor(np.stack([o[k] for o in obs])).to(device) for k in obs[0]},
                 ROW_CONTINUES: torch.from_numpy(cont.copy())}
        out = module.act(batch)
        a = out[Columns.ACTIONS].cpu().numpy().copy()  # copies: a replayed graph's outputs are overwritten
        actions.append(a)
        logps.append(out[Columns.ACTION_LOGP].cpu().numpy().copy())
        for i, e in enumerate(envs):
            o, _, done, _, _ = e.step(int(a[i]))
            obs[i], cont[i] = (e.reset(seed=100 + t)[0], False) if done else (o, True)
    return np.stack(actions), np.stack(logps)


@pytest.mark.parametrize("sampler", [None, {"name": "top_k", "k": 4}, {"name": "top_p", "p": 0.8},
                                     {"name": "typical", "p": 0.9}, {"name": "epsilon", "epsilon": 0.05},
                                     {"name": "eta", "eta": 0.01}, {"name": "mirostat", "tau": 3.0,
                                                                    "learning_rate": 0.5}])
def test_engine_rollout_gives_the_window_caches_tokens_and_log_probs(sampler):
    ring = make_module(sampler)
    window = copy.deepcopy(ring)
    window.kv_cache = WindowKVCache()
    if getattr(window, "row_sampler_state", None) is not None:
        window.row_sampler_state = type(ring.row_sampler_state)(window.sampler)
    a1, l1 = rollout(ring)
    a2, l2 = rollout(window)
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_allclose(l1, l2, atol=1e-5)
    stats = ring.kv_cache.stats
    assert ring.kv_cache.engine is not None and stats["incremental_rows"] > 3 * stats["prefill_rows"]


def _engine_and_window(B=5, L=10):
    module = make_module()
    trunk = module.lm.base_model
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 12, (B, L), generator=g)
    mask = torch.zeros(B, L, dtype=torch.long)
    for r, n in enumerate(torch.randint(1, 4, (B,), generator=g).tolist()):
        mask[r, L - n:] = 1
    return module, trunk, ids, mask


def uncached_last_hidden(trunk, ids, mask) -> torch.Tensor:
    """The trunk's uncached pass over whole windows: the hidden state at each row's newest token."""
    return trunk(input_ids=ids, attention_mask=mask,
                 position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state[:, -1]


def _two_loaded_engines(sampler=None):
    """(module, ids, mask, engine, engine): two engines over the module's trunk, loaded with the same
    windows (dynamo's caches reset, for the tests that compile)."""
    torch._dynamo.reset()
    module = make_module(sampler)
    trunk = module.lm.base_model
    _, _, ids, mask = _engine_and_window()
    engines = DecodeEngine(trunk, 5, 10), DecodeEngine(trunk, 5, 10)
    layers = prefill_pass(trunk, ids, mask)[1]
    for e in engines:
        e.load_rows(None, layers, mask)
    return (module, ids, mask, *engines)


@torch.no_grad()
def test_ring_step_equals_a_whole_window_pass_as_the_slot_wraps_around():
    """Episodes restarted at any slot, stepped past the end of the ring (the slot wraps around),
    give the uncached pass's hidden state at every step."""
    module, trunk, ids, mask = _engine_and_window(L=10)
    engine = DecodeEngine(trunk, 5, 10)
    g = torch.Generator().manual_seed(2)
    for episode in range(3):  # each: every row (re)started, then 6 steps (windows never fill)
        if episode:  # restarts written at the current slot (rows given: the ring does not start over)
            rows = torch.arange(5)
            ids = torch.randint(2, 12, ids.shape, generator=g)
            mask = torch.zeros_like(mask)
            mask[:, -3:] = 1
            engine.load_rows(rows, prefill_pass(trunk, ids, mask)[1], mask)
        else:
            engine.load_rows(None, prefill_pass(trunk, ids, mask)[1], mask)
        for t in range(6):
            token = torch.randint(2, 12, (5,), generator=g)
            ids = torch.cat([ids[:, 1:], token[:, None]], 1)
            mask = torch.cat([mask[:, 1:], torch.ones(5, 1, dtype=torch.long)], 1)
            hidden = engine.step(token)
            torch.testing.assert_close(hidden, uncached_last_hidden(trunk, ids, mask), atol=1e-5, rtol=1e-5)
    # a full load starts the ring at slot 9; 18 steps later (past its end twice): 7, on the device and the host
    assert engine.slot_host == int(engine.slot) == 7


@torch.no_grad()
@pytest.mark.parametrize("captured", [False, True])
def test_a_step_over_the_first_rows_gives_their_window_pass_and_leaves_the_other_rows(captured):
    """A call over the first 3 of an engine's 5 rows (a serving batch stepping only its rows in
    use) gives those rows' uncached hidden states and leaves the other rows' keys and values as
    they were; a call over every row after it goes on with the first 3 (the others' columns are
    stale: a serving batch's idle rows). Captured (emulated on the CPU) as a graph of its own."""
    module, trunk, ids, mask = _engine_and_window(L=10)
    engine = DecodeEngine(trunk, 5, 10)
    if captured:
        capture_on_the_cpu(engine)
    engine.load_rows(None, prefill_pass(trunk, ids, mask)[1], mask)
    others = engine.kv[:, :, 3:].clone()
    g = torch.Generator().manual_seed(2)
    for rows in (3, 3, 3, 5, 5):
        token = torch.randint(2, 12, (5,), generator=g)  # the first 3 rows' windows grow by theirs
        ids = torch.cat([ids[:, 1:], token[:, None]], 1)
        mask = torch.cat([mask[:, 1:], torch.ones(5, 1, dtype=torch.long)], 1)
        hidden = engine.step(token[:rows])
        assert hidden.shape == (rows, trunk.embed_dim)
        torch.testing.assert_close(hidden[:3], uncached_last_hidden(trunk, ids[:3], mask[:3]), atol=1e-5, rtol=1e-5)
        if rows == 3:
            assert torch.equal(engine.kv[:, :, 3:], others)
    if captured:
        assert ("part", 3, None) in engine.graphs and None in engine.graphs


@torch.no_grad()
def test_a_call_over_other_rows_between_two_calls_restarts_the_rows_said_to_continue():
    """A cache whose caller did not set `engine_rows` (not a serving batch): a call over 2 other
    windows between two calls over 4 rows, the second saying its rows continue, restarts them
    (their ring was written over), so every hidden state is the uncached pass's."""
    module, trunk, ids, mask = _engine_and_window(B=4, L=10)
    cache = RingKVCache()

    def call(ids, mask, cont):
        return cache.hidden_at_last_token(trunk, {"input_ids": ids, "attention_mask": mask}, cont)

    def appended(ids, mask, token):
        return torch.cat([ids[:, 1:], token[:, None]], 1), torch.cat([mask[:, 1:], torch.ones_like(mask[:, :1])], 1)

    call(ids, mask, torch.zeros(4, dtype=torch.bool))
    ids, mask = appended(ids, mask, torch.tensor([3, 4, 5, 6]))
    call(ids, mask, torch.ones(4, dtype=torch.bool))
    call(ids[:2].flip(-1), mask[:2], None)  # another caller's 2 windows
    ids, mask = appended(ids, mask, torch.tensor([7, 8, 9, 10]))
    hidden = call(ids, mask, torch.ones(4, dtype=torch.bool))
    torch.testing.assert_close(hidden, uncached_last_hidden(trunk, ids, mask), atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("sampler", [None, {"name": "top_k", "k": 4}, {"name": "top_p", "p": 0.8},
                                     {"name": "typical", "p": 0.9}, {"name": "eta", "eta": 0.01}])
def test_static_step_compiles_with_fullgraph_and_gives_the_eager_steps_outputs(sampler):
    """No graph break in the whole rollout step (trunk, head, mask, draw, log-prob, value): the
    precondition for capturing it as a CUDA graph."""
    module, ids, mask, eager, compiled = _two_loaded_engines(sampler)

    def whole_step(engine, token, uniform):
        return module._sample(engine.step_hidden(token), uniform)

    step = torch.compile(whole_step, fullgraph=True, backend="aot_eager")
    for t in range(4):
        token, uniform = torch.randint(2, 12, (5,)), torch.rand(5, 1, dtype=torch.float64)
        want, got = whole_step(eager, token, uniform), step(compiled, token, uniform)
        assert want.keys() == got.keys()
        torch.testing.assert_close(got[Columns.ACTIONS], want[Columns.ACTIONS])
        torch.testing.assert_close(got[Columns.ACTION_LOGP], want[Columns.ACTION_LOGP], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[Columns.VF_PREDS], want[Columns.VF_PREDS], atol=1e-5, rtol=1e-5)
    for a, b in zip(eager.keys + eager.values, compiled.keys + compiled.values):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_other_trunks_keep_the_window_cache():
    """A trunk the engine cannot run (hooks here) gets WindowKVCache's path, same logits."""
    module = make_module()
    module.lm.base_model.h[0].mlp.register_forward_hook(lambda *a: None)
    plain = make_module(kv_cache=False)
    assert plain.kv_cache is None
    a1, l1 = rollout(module, steps=12)
    a2, l2 = rollout(plain, steps=12)
    assert module.kv_cache.engine is None
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_allclose(l1, l2, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_cuda_graph_step_gives_the_eager_steps_tokens():
    ring = make_module().cuda()
    eager = copy.deepcopy(ring)
    eager.kv_cache = RingKVCache(capture=False)
    a1, l1 = rollout(ring, device="cuda")
    a2, l2 = rollout(eager, device="cuda")
    graphs = ring.kv_cache.engine.graphs  # the step was captured and replayed, with the restarts in it
    assert ("explore", True) in graphs and ("restart", 6, ("explore", True)) in graphs
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_allclose(l1, l2, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_compiled_step_gives_the_eager_steps_tokens(device, monkeypatch):
    """`compile_step` (the experiment of `decode_step_profile.py --compile`): the step through
    torch.compile, captured on CUDA, gives the eager step's tokens over a rollout with restarts
    (inductor on CUDA; on the CPU AOT autograd's eager backend, which traces the same graph without
    the C++ build)."""
    from agents.modules import decode_engine

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if device == "cpu":
        monkeypatch.setattr(decode_engine, "COMPILE_BACKEND", "aot_eager")
    compiled = make_module().to(device)
    plain = copy.deepcopy(compiled)
    compiled.kv_cache = RingKVCache(compile_step=True)
    a1, l1 = rollout(compiled, steps=16, device=device)
    assert 1 <= counters["stats"]["unique_graphs"] <= 3  # the exploring step and the restart step's trunk, once each
    a2, l2 = rollout(plain, steps=16, device=device)
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_allclose(l1, l2, atol=1e-4)


def test_a_step_that_does_not_compile_stops_with_one_line_naming_the_setting(monkeypatch):
    """A compile that fails (inductor on a CPU with no C++ compiler) stops the rollout with one
    line that names `env_runners.compile_step` and the cause, not the compiler's traceback."""
    from agents.modules import decode_engine

    def no_compiler(graph, inputs):
        raise OSError("InvalidCxxCompiler: No working C++ compiler found\n  (details)")

    torch._dynamo.reset()
    monkeypatch.setattr(decode_engine, "COMPILE_BACKEND", no_compiler)
    module = make_module()
    module.kv_cache = RingKVCache(compile_step=True)
    with pytest.raises(RuntimeError) as err:
        rollout(module, steps=4, device="cpu")
    message = str(err.value)
    assert message.startswith("env_runners.compile_step: compiling the decode step failed (")
    assert "No working C++ compiler found" in message and "set env_runners.compile_step: false" in message
    assert "\n" not in message and "OSError" in message
    assert isinstance(err.value.__cause__, torch._dynamo.exc.TorchDynamoException)  # kept for debugging


def test_the_steps_own_errors_are_named_and_errors_of_the_compiled_run_pass_as_they_are(monkeypatch):
    """Under the compile the step's Python runs while it is traced, so an error it raises stops the
    compile: the line names that error. An error of the compiled step when it runs (a device out of
    memory, here raised by the backend's compiled function) is not called a compile failure."""
    from agents.modules import decode_engine

    def broken_tail(hidden, uniform):
        raise ValueError("the tail's own bug")

    def runs_out_of_memory(graph, inputs):
        def run(*args):
            raise torch.OutOfMemoryError("out of memory on the device")
        return run

    module = make_module()
    trunk = module._trunk(module.lm)
    for backend, tail, want in (("aot_eager", broken_tail, "compile_step: compiling the decode step failed"),
                                (runs_out_of_memory, None, "out of memory on the device")):
        torch._dynamo.reset()
        monkeypatch.setattr(decode_engine, "COMPILE_BACKEND", backend)
        engine = DecodeEngine(trunk, 2, 6, compile_step=True)
        with pytest.raises(Exception) as err, torch.no_grad():
            engine.step(torch.zeros(2, dtype=torch.long), tail, (torch.rand(2, 1),) if tail else (), key="k")
        assert want in str(err.value)
        if tail is not None:
            assert "the tail's own bug" in str(err.value)  # the cause, in the one line
        else:
            assert isinstance(err.value, torch.OutOfMemoryError) and "compile_step" not in str(err.value)


def test_env_runners_compile_step_reaches_the_rollout_engine():
    """`env_runners.compile_step` (default off) is what the fast EnvRunner's rollout cache builds
    its engine with."""
    from agents.config import algorithm_config, load
    from agents.env_runner import FastTokenEnvRunner
    from tests.conftest import QUICKSTART

    for setting, want in (([], False), (["env_runners.compile_step=true"], True)):
        runner = FastTokenEnvRunner(config=algorithm_config(load(QUICKSTART, setting)))
        try:
            assert runner.module.kv_cache.compile_step is want
        finally:
            runner.stop()


def test_rollout_benchmark_engine_row_samples_every_token_and_counts_the_bytes_a_step_reads():
    """benchmarks/rollout_throughput.py (e): the engine alone, as the EnvRunner's module runs it."""
    import argparse

    from benchmarks.rollout_throughput import engine_path, make_env_runner

    args = argparse.Namespace(model="tiny-gpt2", vocab=52, batch=4, prompt=6, new=5, device="cpu", precision="fp32")
    report = {}
    rep = engine_path(args, report)
    tokens, seconds = rep()
    assert tokens == 4 * 5 and seconds > 0 and len(report["step_s"]) == 1
    # tiny-gpt2 (tied embedding once) in float32, plus 2 layers' keys and values of 4 rows x 11 columns x 64
    weights = sum(p.nbytes for p in make_env_runner(args, True, "fast").module.parameters())
    assert report["bytes"] == weights + 2 * 2 * 4 * 11 * 64 * 4


def test_greedy_evaluation_in_blocks_of_four_replays_half_the_graphs_and_runs_fewer_ops_outside_them():
    """benchmarks/rollout_throughput.py --greedy-blocks 1 4 --count-ops: with the graphs emulated, a
    greedy step of blocks of 1 replays one graph; blocks of 4 replay two per 4 steps (the first
    step's, the later three's) and run fewer ops outside them."""
    import argparse

    from benchmarks.rollout_throughput import greedy_ops

    args = argparse.Namespace(model="tiny-gpt2", vocab=52, batch=8, prompt=6, new=16, device="cpu", precision="fp32",
                              decode_block=None)
    (ops1, replays1), (ops4, replays4) = greedy_ops(args, 1), greedy_ops(args, 4)
    assert replays1 * 8 == pytest.approx(1.0, rel=0.05) and replays4 * 8 == pytest.approx(0.5, rel=0.1)
    assert 0 < ops4 < ops1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_host_transfers_round_trip_a_steps_observations_and_outputs(device):
    from agents.modules.host_transfers import HostTransfers

    transfers = HostTransfers()
    for step in range(3):  # buffers are reused step after step
        ids = np.arange(12, dtype=np.int64).reshape(3, 4) + step
        on_device = transfers.to_device("input_ids", ids, torch.device(device))
        assert on_device.device.type == device
        out = transfers.to_host({"actions": on_device[:, -1] * 2, "logp": on_device[:, 0].float() / 2})
        np.testing.assert_array_equal(out["actions"], ids[:, -1] * 2)
        np.testing.assert_allclose(out["logp"], ids[:, 0] / 2)


@torch.no_grad()
def test_warm_up_before_capture_leaves_the_ring_as_it_was():
    """The steps run before a CUDA graph is captured (on the CPU here) undo their writes."""
    _, trunk, ids, mask = _engine_and_window(L=10)
    engine = DecodeEngine(trunk, 5, 10)
    engine.load_rows(None, prefill_pass(trunk, ids, mask)[1], mask)
    engine.step(torch.full((5,), 3))
    before = [t.clone() for t in engine.keys + engine.values + [engine.real, engine.slot]]
    engine._warm_up(lambda: engine.step_hidden(torch.full((5,), 4)), times=3)
    for a, b in zip(before, engine.keys + engine.values + [engine.real, engine.slot]):
        assert torch.equal(a, b)


@torch.no_grad()
def test_restarted_rows_are_written_in_as_many_ops_whatever_the_number_of_layers():
    """A step that restarts rows writes their prefills into the ring in a few ops (not two per
    layer), from the stacked keys/values or from per-layer pairs alike."""
    from transformers import GPT2Config, GPT2Model

    from benchmarks.emulated_capture import count_ops

    counts = []
    for n_layer in (2, 6):
        torch.manual_seed(0)
        trunk = GPT2Model(GPT2Config(vocab_size=30, n_positions=16, n_layer=n_layer, n_head=2, n_embd=16)).eval()
        ids = torch.randint(2, 12, (5, 10))
        mask = torch.zeros(5, 10, dtype=torch.long)
        mask[:, -3:] = 1
        stacked, per_layer = DecodeEngine(trunk, 5, 10), DecodeEngine(trunk, 5, 10)
        _, kv = prefill_pass(trunk, ids, mask, stacked=True)
        _, layers = prefill_pass(trunk, ids, mask)
        stacked.load_rows(None, kv, mask)
        per_layer.load_rows(None, layers, mask)
        for e in (stacked, per_layer):
            e.step(torch.full((5,), 3))
        rows = torch.tensor([1, 3])
        counts.append(count_ops(lambda: stacked.load_rows(rows, kv[:, :, rows], mask[rows])))
        per_layer.load_rows(rows, [(k[rows], v[rows]) for k, v in layers], mask[rows])
        assert torch.equal(stacked.kv, per_layer.kv) and torch.equal(stacked.real, per_layer.real)
        assert stacked.keys[1].data_ptr() == stacked.kv[0, 1].data_ptr()  # the layers' views are the buffer
    assert counts[0] == counts[1] <= 8


@torch.no_grad()
def test_rows_restarting_on_one_stored_window_share_it_without_a_copy():
    from agents.modules.kv_cache import WindowKVCache

    _, trunk, ids, mask = _engine_and_window()
    same_ids, same_mask = ids[:1].expand(4, -1), mask[:1].expand(4, -1)
    cache = WindowKVCache()
    hidden, kv = cache._prefill(trunk, same_ids, same_mask)  # computed once, stored
    want_hidden, want_kv = prefill_pass(trunk, ids[:1], mask[:1], stacked=True)
    torch.testing.assert_close(hidden, want_hidden.expand(4, -1))
    torch.testing.assert_close(kv, want_kv.expand(-1, -1, 4, -1, -1, -1))
    again_hidden, again_kv = cache._prefill(trunk, same_ids, same_mask)  # from the store: a view of its entry
    (_, entry), = cache.store.entries.values()
    assert again_kv.data_ptr() == entry.data_ptr() and again_kv.stride(2) == 0
    assert cache.stats["prefill_computed_rows"] == 1
    mixed_hidden, mixed_kv = cache._prefill(trunk, ids[:3], mask[:3])  # two new windows join the stored one
    real = mask[:3][None, None, :, None, :, None]  # a pass leaves padding columns as it finds them
    torch.testing.assert_close(mixed_kv * real, prefill_pass(trunk, ids[:3], mask[:3], stacked=True)[1] * real)
    assert cache.stats["prefill_computed_rows"] == 3


def replay_into_static_outputs(engine) -> None:
    """The engine's steps return the same output tensors every time, overwritten in place, as a
    replayed CUDA graph's static outputs are (on the CPU, where nothing is captured)."""
    step, static = engine.step, {}

    def replayed(token, tail=None, tail_inputs=(), key=None):
        out = step(token, tail, tail_inputs, key)
        if not isinstance(out, dict):
            return out
        for k, v in out.items():
            static.setdefault((key, k), torch.empty_like(v)).copy_(v)
        return {k: static[(key, k)] for k in out}

    engine.step = replayed


@torch.no_grad()
@pytest.mark.parametrize("device", ["cpu", "cpu-static-outputs", "cpu-captured", pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_block_of_steps_on_the_device_gives_one_act_per_step(device):
    """`act_steps` (env_runners.decode_block): 5 steps, the 4 after the first in one static function
    (on CUDA one captured graph, no host sync between the steps), give the tokens, log-probs
    and values of 5 `act` calls on the same windows shifted on the host. `cpu-static-outputs`:
    each step's outputs land in the same tensors, as a CUDA graph's do; `cpu-captured`: the
    engine's capture path emulated on the CPU."""
    from agents.modules.acting import shift_windows

    static, captured = device == "cpu-static-outputs", device == "cpu-captured"
    device = "cpu" if static or captured else device
    module = make_module().to(device)
    envs = [TokenGenerationEnv(ENV_CFG) for _ in PROMPTS]
    obs = [e.reset(seed=i, options={"prompt": p})[0] for i, (e, p) in enumerate(zip(envs, PROMPTS))]
    window = {k: torch.as_tensor(np.stack([o[k] for o in obs])).to(device) for k in obs[0]}
    first = {Columns.OBS: window, ROW_CONTINUES: torch.zeros(len(PROMPTS), dtype=torch.bool)}
    generator = module.rollout_generator(torch.device(device))
    start = generator.get_state()
    if static or captured:  # the engine exists after a first call; build it, then make its outputs static
        module.act(first)
        module.weights_changed()
        (capture_on_the_cpu if captured else replay_into_static_outputs)(module.kv_cache.engine)
        generator.set_state(start)
    block = module.act_steps(first, 5)
    last = window  # the cache's windows after the block: the first shifted by the 4 tokens appended in it
    for j in range(4):
        last = shift_windows(last, block[Columns.ACTIONS][j])
    assert torch.equal(module.kv_cache.ids, last["input_ids"]) and torch.equal(module.kv_cache.mask,
                                                                               last["attention_mask"])
    generator.set_state(start)
    module.weights_changed()
    for j in range(5):
        out = module.act({Columns.OBS: window, ROW_CONTINUES: torch.full((len(PROMPTS),), j > 0)})
        for key, value in out.items():
            np.testing.assert_allclose(block[key][j].float().cpu().numpy(), value.float().cpu().numpy(), atol=1e-5)
        host = shift_windows({k: v.cpu() for k, v in window.items()}, out[Columns.ACTIONS].cpu())  # on the host
        window = {k: v.to(device) for k, v in host.items()}
    assert block[Columns.ACTIONS].shape == (5, len(PROMPTS))
    if device == "cuda" or captured:
        assert ("steps", 4, ("explore", True)) in module.kv_cache.engine.graphs


@torch.no_grad()
@pytest.mark.parametrize("sampler", [None, {"name": "top_k", "k": 4}, {"name": "typical", "p": 0.9}])
@pytest.mark.parametrize("how", ["eager", "captured-on-cpu"])
def test_restarts_inside_the_static_step_give_the_eager_prefills_tokens_and_log_probs(sampler, how):
    """`static_restarts` (the default where the engine captures: a GPU): rows that restart are
    prefilled inside the static step, every one of them (no sharing by window), in a few restart
    functions (one per bucket of rows), and the rollout's tokens and log-probs are the eager
    prefills'. `captured-on-cpu`: through the capture path (warm-up, static inputs and outputs)."""
    static = make_module(sampler)
    eager = copy.deepcopy(static)
    static.kv_cache.static_restarts, eager.kv_cache.static_restarts = True, False
    for m in (static, eager):
        m.seed_rollouts(0)
    if how == "captured-on-cpu":
        generator = static.rollout_generator(torch.device("cpu"))
        start = generator.get_state()
        static.act({Columns.OBS: {k: torch.as_tensor(v)[None].repeat(len(PROMPTS), 1) for k, v in
                                  TokenGenerationEnv(ENV_CFG).reset(seed=0)[0].items()},
                    ROW_CONTINUES: torch.zeros(len(PROMPTS), dtype=torch.bool)})  # builds the engine
        static.weights_changed()
        static.kv_cache.stats.update(dict.fromkeys(static.kv_cache.stats, 0))
        capture_on_the_cpu(static.kv_cache.engine)  # the capture path: warm-up, static inputs and outputs
        generator.set_state(start)
    a1, l1 = rollout(static, steps=40)
    a2, l2 = rollout(eager, steps=40)
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_allclose(l1, l2, atol=1e-5)
    s, e = static.kv_cache.stats, eager.kv_cache.stats
    assert s["prefill_rows"] == e["prefill_rows"] == s["prefill_computed_rows"] > e["prefill_computed_rows"]
    if how == "captured-on-cpu":
        names = set(static.kv_cache.engine.graphs)
        restarts = {n for n in names if n[0] == "restart"}
        assert names - restarts == {("explore", True)}  # no eager prefill, no separate tail
        assert restarts == {("restart", 6, ("explore", True))}  # 6 rows: one bucket


@torch.no_grad()
def test_the_restart_step_compiles_with_fullgraph_and_writes_the_eager_prefills_into_the_ring():
    """The step with restarts (trunk, prefill of the restarting rows, ring writes, head, draw) has
    no graph break: the precondition for capturing it. Its hidden states and the ring's real
    columns equal a step followed by `load_rows` of eager prefills."""
    module, ids, mask, want, got = _two_loaded_engines()
    trunk = module.lm.base_model

    def whole_step(engine, token, ids, mask, fill, uniform):
        return module._sample(engine.restart_hidden(token, ids, mask, fill), uniform)

    step = torch.compile(whole_step, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    for t in range(12):  # past the ring's end
        token, uniform = torch.randint(2, 12, (5,), generator=g), torch.rand(5, 1, dtype=torch.float64, generator=g)
        ids = torch.cat([ids[:, 1:], token[:, None]], 1)
        mask = torch.cat([mask[:, 1:], torch.ones(5, 1, dtype=torch.long)], 1)
        fill = torch.tensor([t % 5, (t + 2) % 5, t % 5])  # two rows restart (one named twice)
        ids[fill], mask[fill] = torch.randint(2, 12, (3, 10), generator=g), (torch.arange(10) >= 7).long()
        out = step(got, token, ids, mask, fill, uniform)
        hidden = want.step(token).clone()
        h_fill, kv = prefill_pass(trunk, ids[fill[:2]], mask[fill[:2]], stacked=True)
        want.load_rows(fill[:2], kv, mask[fill[:2]])
        hidden[fill[:2]] = h_fill
        expected = module._sample(hidden, uniform)
        torch.testing.assert_close(out[Columns.ACTIONS], expected[Columns.ACTIONS])
        torch.testing.assert_close(out[Columns.ACTION_LOGP], expected[Columns.ACTION_LOGP], atol=1e-5, rtol=1e-5)
        assert torch.equal(got.real, want.real) and torch.equal(got.slot, want.slot)
        real = want.real[None, None, :, None, :, None]
        torch.testing.assert_close(got.kv * real, want.kv * real, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_restarts_take_the_step_by_default_where_the_engine_captures_windows_of_at_most_the_limit(monkeypatch):
    """`static_restarts` None: restarts in the step where the engine captures (emulated on the CPU
    here) and its windows are at most RESTART_MAX_COLUMNS long (a longer window's restarts pass over
    its padding too: they stay eager); never where it does not capture."""
    from agents.modules import decode_engine
    from benchmarks.emulated_capture import capturing_init

    _, trunk, ids, mask = _engine_and_window(L=10)
    verdicts = {}
    for captured, limit in ((True, 10), (True, 9), (False, 10)):
        monkeypatch.setattr(decode_engine, "RESTART_MAX_COLUMNS", limit)
        with monkeypatch.context() as m:
            if captured:
                m.setattr(DecodeEngine, "__init__", capturing_init())
            cache = RingKVCache()
            for _ in range(2):  # the first call checks the tensor-op pass (eagerly), the second may restart in the step
                cache.invalidate()
                cache.hidden_at_last_token(trunk, {"input_ids": ids, "attention_mask": mask})
        verdicts[captured, limit] = (cache.restarts_in_step, any(isinstance(n, tuple) and n[0] == "restart"
                                                                  for n in cache.engine.graphs))
    assert verdicts == {(True, 10): (True, True), (True, 9): (False, False), (False, 10): (False, False)}


def test_restart_buckets_are_powers_of_two_between_eight_and_the_rows():
    from agents.modules.decode_engine import restart_bucket

    assert [restart_bucket(n, 128) for n in (1, 8, 9, 16, 17, 33, 64, 65, 127, 128)] == [
        8, 8, 16, 16, 32, 64, 64, 128, 128, 128]
    assert [restart_bucket(n, 6) for n in (1, 5, 6)] == [6, 6, 6]
    assert len({restart_bucket(n, 128) for n in range(1, 129)}) == 5


@torch.no_grad()
def test_a_captured_step_with_restarts_runs_as_many_ops_outside_its_graph_whatever_the_depth():
    """With the engine's capture emulated on the CPU, a step where rows restart runs the same
    number of ops outside its graph (each a kernel launch on a GPU) at 2 and at 6 layers, and
    fewer than with eager prefills, whose ops grow with the layers."""
    from transformers import GPT2Config, GPT2Model

    from benchmarks.emulated_capture import OpCounter, emulate_capture

    counts = {}
    for n_layer in (2, 6):
        torch.manual_seed(0)
        trunk = GPT2Model(GPT2Config(vocab_size=30, n_positions=16, n_layer=n_layer, n_head=2, n_embd=16)).eval()
        ids = torch.randint(2, 12, (16, 10))
        mask = (torch.arange(10) >= 7).long().expand(16, -1).contiguous()
        cont = torch.ones(16, dtype=torch.bool)
        cont[::3] = False
        for static in (True, False):
            counter = OpCounter()
            with emulate_capture(counter):
                cache = RingKVCache()
                cache.static_restarts = static
                cache.hidden_at_last_token(trunk, {"input_ids": ids, "attention_mask": mask})  # a full load
                for _ in range(2):  # the second call replays the graph the first captured
                    ids = torch.randint(2, 12, (16, 10))  # windows not stored yet: eager prefills compute them
                    counter.n = 0
                    with counter:
                        cache.hidden_at_last_token(trunk, {"input_ids": ids, "attention_mask": mask}, cont)
            assert cache.engine.capture and cache.stats["prefill_rows"] == 16 + 2 * 6
            counts[n_layer, static] = counter.n
    assert counts[2, True] == counts[6, True] < counts[2, False] < counts[6, False], counts


@torch.no_grad()
def test_a_blocks_steps_compile_with_fullgraph_and_give_the_steps_one_at_a_time():
    """`DecodeEngine.steps`' function (3 steps, each appending the token the one before drew) has
    no graph break: the precondition for capturing a block's steps as one graph. It gives 3
    `step` calls' outputs and leaves the same ring."""
    module, _, _, one_by_one, compiled = _two_loaded_engines()
    block = torch.compile(lambda token, uniforms: compiled._steps(module._sample, token, (uniforms,),
                                                                  lambda out: out[Columns.ACTIONS]),
                          fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(4)
    for _ in range(3):  # 9 steps: past the ring's end
        token, uniforms = torch.randint(2, 12, (5,), generator=g), torch.rand(3, 5, 1, dtype=torch.float64, generator=g)
        got = block(token, uniforms)
        for j in range(3):
            want = one_by_one.step(token, module._sample, (uniforms[j],), key="explore")
            for k in want:
                torch.testing.assert_close(got[k][j], want[k], atol=1e-5, rtol=1e-5)
            token = want[Columns.ACTIONS]
    assert torch.equal(compiled.real, one_by_one.real) and torch.equal(compiled.slot, one_by_one.slot)
    torch.testing.assert_close(compiled.kv, one_by_one.kv, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("sampler", [None, {"name": "top_k", "k": 4}])
def test_a_greedy_blocks_steps_compile_with_fullgraph_and_take_the_masked_argmax(sampler):
    """The greedy rollout step (`Acting._greedy`, evaluation's) as a block of 3 steps: no graph
    break, each step's token the argmax of the sampler-masked logits at the hidden state the
    one-at-a-time steps reach, its log-prob that token's."""
    module, _, _, one_by_one, compiled = _two_loaded_engines(sampler)
    block = torch.compile(lambda token, placeholder: compiled._steps(module._greedy, token, (placeholder,),
                                                                     lambda out: out[Columns.ACTIONS]),
                          fullgraph=True, backend="aot_eager")
    token = torch.randint(2, 12, (5,), generator=torch.Generator().manual_seed(5))
    for _ in range(3):  # 9 steps: past the ring's end
        got = block(token, torch.zeros(3, 1))
        for j in range(3):
            logits = module._masked_logits(one_by_one.step_hidden(token))[0]
            torch.testing.assert_close(got[Columns.ACTIONS][j], logits.argmax(-1))
            torch.testing.assert_close(got[Columns.ACTION_LOGP][j], torch.log_softmax(logits, -1).max(-1).values,
                                       atol=1e-5, rtol=1e-5)
            token = got[Columns.ACTIONS][j]
        assert sampler is None or bool((logits == MASKED).any())  # the mask was on
    torch.testing.assert_close(compiled.kv, one_by_one.kv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["compiled", "captured-on-cpu", "window-cache"])
def test_a_copy_of_a_policy_that_has_generated_generates_the_originals_tokens(how, monkeypatch):
    """A policy deep-copied (or pickled) after its rollouts: the copy's captured graphs, compiled
    steps and cached step function are its own, rebuilt on its first call (the original's run on
    the original's ring and weights), so for the same seed it draws the original's tokens, and
    still does once the original's weights change."""
    import pickle

    from agents.modules import decode_engine

    torch._dynamo.reset()
    monkeypatch.setattr(decode_engine, "COMPILE_BACKEND", "aot_eager")
    module = make_module()
    module.kv_cache = {"compiled": RingKVCache(compile_step=True), "captured-on-cpu": RingKVCache(),
                       "window-cache": WindowKVCache()}[how]
    if how == "captured-on-cpu":
        rollout(module, steps=1)  # builds the engine
        capture_on_the_cpu(module.kv_cache.engine)
    rollout(module, steps=10)
    copies = [copy.deepcopy(module)]
    if how != "captured-on-cpu":  # (the emulation's capture function is the test's own closure)
        copies.append(pickle.loads(pickle.dumps(module)))
    for twin in copies:
        if how == "captured-on-cpu":
            capture_on_the_cpu(twin.kv_cache.engine)  # the copy's engine captures as the original's does
    want, want_logp = rollout(module, steps=10, seed=3)
    with torch.no_grad():
        module.lm.base_model.h[0].mlp.c_fc.weight.mul_(3.0)
    module.weights_changed()
    for twin in copies:
        got, got_logp = rollout(twin, steps=10, seed=3)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(got_logp, want_logp, atol=1e-5)
