"""A serving batch's blocks on the decode engine (`agents.modules.decoding.rows_block`): each row's
requested sampler, temperature, top_p and draw inside the static steps (`samplers.row_tokens`),
the same texts as one module call per token, graphs replayed where the engine captures (emulated
on the CPU), and per-row sampler masks equal to each row's own."""
import threading

import numpy as np
import pytest
import torch

from agents.samplers import (ROW_SAMPLER_CODES, ROW_SAMPLERS, SAMPLERS, row_sampler_keep, row_tokens,
                             sample_rows, warp_logits)
from agents.serve.batching import Batcher, Completion, Job
from tests.test_generate_decoder import eos_likely
from tests.test_serve_batching import build_module

PARAMS = {"top_k": [1, 2, 3, 7, 40], "top_p": [0.1, 0.5, 0.9, 0.95, 0.999], "typical": [0.2, 0.5, 0.9, 0.95],
          "epsilon": [1e-4, 3e-3, 0.02, 0.1], "eta": [1e-4, 3e-4, 2e-3, 0.05]}


def logits_rows(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows from flat to peaked, with ties (rounded logits) in half of them."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1.3, rows)[:, None]
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits[::2] = (logits[::2] * 2).round() / 2
    return logits


@pytest.mark.parametrize("vocab", [52, 1000])
def test_each_rows_mask_is_the_one_its_own_number_gives(vocab):
    """`row_sampler_keep` at per-row parameters (float64) keeps, for every row, exactly what the
    sampler keeps for that row alone at its number: the masks of a serving batch's static tail
    are the ones each request's sampler would apply on its own."""
    for name in ROW_SAMPLERS:
        values = PARAMS[name]
        logits = logits_rows(4 * len(values), vocab, seed=vocab)
        param = torch.tensor([[float(values[i % len(values)])] for i in range(len(logits))], dtype=torch.float64)
        batched = row_sampler_keep(logits, name, param)
        fn = SAMPLERS[name][0]
        for i in range(len(logits)):
            value = values[i % len(values)]
            alone = fn(logits[i:i + 1], value)[0]
            assert torch.equal(batched[i], alone), (name, value, i)
        assert 0 < batched.sum() < batched.numel()  # the masks drop something and keep something


def test_row_tokens_draw_each_row_as_its_own_settings_draw_alone():
    """Greedy rows take the argmax; sampled rows draw at their uniform from the softmax after their
    own sampler's mask, temperature and top_p: the draw one row makes alone with numbers (as
    `agents.generate` and a replica serving one request at a time make it)."""
    logits = logits_rows(24, 52, seed=1)
    names = ("none",) + ROW_SAMPLERS
    settings = []
    for i in range(len(logits)):
        name = names[i % len(names)]
        value = PARAMS[name][i % len(PARAMS[name])] if name != "none" else 0.0
        settings.append((i % 5 == 4, [1.0, 0.7, 1.6][i % 3], [1.0, 0.9, 0.6, 1.0][i % 4], name, value))
    uniform = torch.rand(len(logits), 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    greedy = torch.tensor([s[0] for s in settings])
    temperature = torch.tensor([[s[1]] for s in settings], dtype=torch.float32)
    top_p = torch.tensor([[s[2]] for s in settings], dtype=torch.float64)  # as the batcher gives it
    kind = torch.tensor([ROW_SAMPLER_CODES.get(s[3], 0) for s in settings])
    param = torch.tensor([[float(s[4])] for s in settings], dtype=torch.float64)
    kinds = tuple(n for n in ROW_SAMPLERS if n in {s[3] for s in settings})
    tokens = row_tokens(logits, uniform, greedy, temperature, top_p, kind, param, kinds=kinds)
    # each sampler on its own rows only (an uncaptured step's way): the same tokens
    assert torch.equal(row_tokens(logits, uniform, greedy, temperature, top_p, kind, param, kinds=kinds,
                                  subsets=True), tokens)
    for i, (is_greedy, t, p, name, value) in enumerate(settings):
        row = logits[i:i + 1]
        if is_greedy:
            assert tokens[i] == row.argmax(), i
            continue
        if name != "none":
            row = row.masked_fill(~SAMPLERS[name][0](row, value), torch.finfo(torch.float32).min)
        probs = torch.softmax(warp_logits(row, t, p), -1)  # numbers, as generate() warps
        assert tokens[i] == sample_rows(probs, uniform[i:i + 1])[0], (i, name, value, t, p)
    # every row greedy: the argmax alone, no draw
    assert torch.equal(row_tokens(logits, uniform, greedy, temperature, top_p, kind, param, sampled=False),
                       logits.argmax(-1))


def completions() -> list[Completion]:
    """Every per-request setting a block carries (no mirostat: it steps one token per call)."""
    out = [Completion("3 7 12", s, 20, temperature=t, top_p=p)
           for s, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (2.0, 1.0), (1.0, 0.5)])]
    out += [Completion("1 2", 40, 7, greedy=True), Completion("5", 41, 20, stop=("1",))]
    out += [Completion("9 8", 50 + i, 20, temperature=1.5, sampler=(("name", name), (SAMPLERS[name][1][0], v)))
            for i, (name, v) in enumerate([("top_k", 4), ("top_p", 0.8), ("typical", 0.6), ("epsilon", 0.02),
                                            ("eta", 0.002)])]
    return out


def texts_of(batcher: Batcher, items: list[Completion]) -> list[dict]:
    jobs = [batcher.submit(Job([c])) for c in items]
    return [j.wait(timeout=120)[0] for j in jobs]


@pytest.fixture(scope="module")
def module():
    return eos_likely(build_module("sampler.name=top_k", "sampler.k=8"), by=2.0)


def test_blocks_write_what_one_call_per_token_writes(module, monkeypatch):
    """The same completions through blocks of 8 and 3 (shorter where no row has that many tokens
    left) and through one module call per token (the path a mirostat request takes): every result
    equal, rows ending mid-block among them."""
    env_config = dict(module.model_config["env"])
    stepped = Batcher(module, env_config, rows=4)
    with monkeypatch.context() as patch:  # the one-call-per-token path for every step
        patch.setattr("agents.serve.batching.blocks_apply", lambda module, slots: False)
        want = texts_of(stepped, completions())
    assert stepped.load()["steps"] == stepped.load()["blocks"] and stepped.load()["dropped"] == 0
    stepped.close()
    for block in (8, 3):
        batcher = Batcher(module, env_config, rows=4, block=block)
        assert texts_of(batcher, completions()) == want
        load = batcher.load()
        assert load["blocks"] < load["steps"] <= block * load["blocks"]
        assert load["dropped"] > 0  # rows ended inside a block (their block's later tokens dropped)
        batcher.close()
    assert any(r["finish_reason"] == "stop" for r in want)  # EOS or a stop string ended some
    assert len({r["text"] for r in want}) > 8


def test_an_idle_replicas_streamed_request_gets_its_first_text_after_one_step(module):
    """Where every row in use has just joined and one streams, the block is one step (the first
    streamed text goes out after one step, not a whole block); the blocks after it, and a request
    not streamed, take the whole block. The texts are the same either way."""
    batcher = Batcher(module, dict(module.model_config["env"]), rows=4)
    steps = [0]  # the batch's steps after each block
    batcher.on_step = lambda: steps.append(batcher.load()["steps"])
    c = Completion("3 7 12", 5, 20, temperature=0.7)
    plain = batcher.submit(Job([c])).wait(timeout=120)
    for _ in range(600):  # the job ends inside a block; its `on_step` comes after
        if steps[-1] == batcher.load()["steps"]:
            break
        threading.Event().wait(0.01)
    plain_blocks, start = np.diff(steps).tolist(), len(steps) - 1
    streamed = batcher.submit(Job([c], stream=True)).wait(timeout=120)
    batcher.close()
    blocks = np.diff(steps[start:]).tolist()
    assert streamed == plain and plain[0]["num_generated"] > 9
    assert plain_blocks[0] == 8 and blocks[:2] == [1, 8]


def test_blocks_replay_their_graphs_where_the_engine_captures(module):
    """With capture emulated on the CPU: the batch's blocks replay graphs (the step, its restarts
    and the block's later steps, each with the row tail) and write what eager blocks write; a
    mirostat request among the rows steps them one call at a time, then blocks resume."""
    from benchmarks.emulated_capture import OpCounter, emulate_capture

    env_config = dict(module.model_config["env"])
    eager = Batcher(module, env_config, rows=4)
    items = completions()
    want = texts_of(eager, items)
    eager.close()
    fresh = build_module("sampler.name=top_k", "sampler.k=8")
    fresh.load_state_dict(module.state_dict())
    counter = OpCounter()
    with emulate_capture(counter):
        batcher = Batcher(fresh, env_config, rows=4)
        assert texts_of(batcher, items) == want
        miro = Completion("3 7 12", 9, 20, sampler=(("name", "mirostat"), ("tau", 2.0), ("learning_rate", 0.5)))
        mixed = texts_of(batcher, [miro, *items[:3]])
        assert mixed[1:] == want[:3] and mixed[0] == texts_of(batcher, [miro])[0]
        engine = fresh.kv_cache.engine
        assert engine.capture and counter.replays > 0
        names = set(engine.graphs)
        assert any(n[0] == "steps" and n[-1][0] == "rows" for n in names if isinstance(n, tuple)), names
        # the replica reports the engine's captures (those of graphs dropped since included)
        assert batcher.load()["graphs_captured"] == engine.captures >= len(engine.graphs) > 0
        batcher.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocks_on_cuda_replay_their_graphs_and_write_what_one_call_per_token_writes(monkeypatch):
    """On a GPU the batch's blocks are captured graphs (the step with its restarts, the block's
    later steps, each with the row tail): the same results as one module call per token on the same
    GPU, and no graph captured once every shape has run."""
    module = eos_likely(build_module("sampler.name=top_k", "sampler.k=8"), by=2.0).to("cuda")
    env_config = dict(module.model_config["env"])
    stepped = Batcher(module, env_config, rows=4)
    with monkeypatch.context() as patch:
        patch.setattr("agents.serve.batching.blocks_apply", lambda module, slots: False)
        want = texts_of(stepped, completions())
    stepped.close()
    batcher = Batcher(module, env_config, rows=4)
    assert texts_of(batcher, completions()) == want
    engine = module.kv_cache.engine
    graphs = set(engine.graphs)
    assert engine.capture and any(isinstance(n, tuple) and n[0] == "steps" for n in graphs), graphs
    assert texts_of(batcher, completions()) == want and set(engine.graphs) == graphs
    batcher.close()
