"""`agents.generate.generate` on the decode engine (`agents.modules.decoding.Decoder`): the same
results as one module call per token (`decoder=False`), greedy or sampled, with the samplers, in
padded batches and with rows that end at EOS mid-block; the blocks as graphs where the engine
captures (emulated on the CPU; on CUDA where there is one)."""
import pytest
import torch

from agents.generate import _DECODERS, decodes_on_engine, generate
from tests.test_serve_batching import build_module

PROMPTS = [None] * 9 + ["3 7 12", "40 41 42 43 44 45 46"]  # drawn prompts, and two given ones

SAMPLERS = {"none": (), "top_k": ("sampler.name=top_k", "sampler.k=3"), "typical": ("sampler.name=typical",
                                                                                   "sampler.p=0.5"),
            "mirostat": ("sampler.name=mirostat", "sampler.tau=3.0", "sampler.learning_rate=0.5")}


def eos_likely(module, by: float = 4.0):
    """`module` with EOS's logit raised by `by` (the final layer norm's bias moved along EOS's output
    embedding), so sampled rows end at EOS at different steps."""
    with torch.no_grad():
        w = module.lm.get_output_embeddings().weight[module.tokenizer.eos_token_id]
        module.lm.base_model.ln_f.bias.add_(by * w / w.norm() ** 2)
    return module


@pytest.fixture(scope="module", params=list(SAMPLERS))
def sampler_module(request):
    return request.param, eos_likely(build_module(*SAMPLERS[request.param]))


@pytest.mark.parametrize("greedy, temperature, top_p", [(True, 1.0, 1.0), (False, 1.0, 1.0), (False, 2.5, 0.95)])
def test_decodes_on_the_engine_equal_one_call_per_token(sampler_module, greedy, temperature, top_p):
    """Batches of 4 (the last one 3 rows, padded to the decoder's 8), each row drawing from its own
    generator: every result (text, reward, token counts, EOS) equals the stepwise loop's; at the
    hotter temperature some rows end at EOS (mid-block: the first step and blocks of 8 cover 20)."""
    name, module = sampler_module
    env_config = dict(module.model_config["env"])
    kwargs = dict(greedy=greedy, seed=5, temperature=temperature, top_p=top_p, batch_size=4)
    stepped = generate(module, env_config, PROMPTS, decoder=False, **kwargs)
    decoder = _DECODERS.get(module)
    before = decoder.cache.stats["incremental_rows"] if decoder is not None else 0
    decoded = generate(module, env_config, PROMPTS, **kwargs)
    assert decoded == stepped
    on_engine = decodes_on_engine(module, greedy)
    assert on_engine == (greedy or name != "mirostat")  # mirostat's sampled state follows each token
    decoder = _DECODERS.get(module)
    stepped_on_engine = decoder is not None and decoder.cache.stats["incremental_rows"] > before
    assert stepped_on_engine == on_engine  # the decoder's engine took this call's steps, or it was not used
    if on_engine:
        assert decoder.rows == 8
    if temperature > 2:
        ends = {r["num_generated"] for r in decoded if r["eos"]}
        assert ends and any(n not in (1, 9, 17) for n in ends), ends  # EOS inside a block, not at its end
        assert any(not r["eos"] and r["num_generated"] == env_config["max_new_tokens"] for r in decoded)


def test_a_trunk_the_engine_does_not_serve_decodes_one_call_per_step_to_the_same_results():
    """With the policy's cache off the engine (as for a trunk other than a plain GPT-2), the decoder
    takes one call per step (no static blocks) and still gives the stepwise loop's results."""
    module = eos_likely(build_module("sampler.name=top_k", "sampler.k=5"))
    module.kv_cache.use_engine = False
    env_config = dict(module.model_config["env"])
    for greedy in (False, True):
        kwargs = dict(greedy=greedy, seed=3, temperature=2.0, batch_size=6)
        assert generate(module, env_config, PROMPTS, **kwargs) == generate(module, env_config, PROMPTS,
                                                                           decoder=False, **kwargs)
    assert _DECODERS[module].cache.engine is None


def test_decoded_texts_do_not_depend_on_the_batch():
    """Row i draws from its own generator (seed + i), k uniforms a block: the same texts in
    batches of 1, 4 and 16."""
    module = build_module("sampler.name=top_k", "sampler.k=5")
    env_config = dict(module.model_config["env"])
    runs = [generate(module, env_config, PROMPTS, seed=2, temperature=2.0, batch_size=b) for b in (1, 4, 16)]
    texts = [[r["generation"] for r in run] for run in runs]
    assert texts[0] == texts[1] == texts[2]
    assert len(set(texts[0])) > 5  # not one text for every row


def test_decodes_replay_the_blocks_captured_by_the_first_calls():
    """With capture emulated on the CPU: calls with 3, 5 and 2 prompts share one engine (8 rows);
    after the second call (the first to prefill inside a graph) no graph is captured, the blocks replay, and the results equal the
    stepwise loop's, after a weight change too."""
    from benchmarks.emulated_capture import OpCounter, emulate_capture

    module = build_module("sampler.name=top_k", "sampler.k=3")
    env_config = dict(module.model_config["env"])
    counter = OpCounter()
    graphs = []
    with emulate_capture(counter):
        for i, prompts in enumerate([[None] * 3, [None] * 5, ["3 7 12", None]] * 2):
            kwargs = dict(seed=i, temperature=1.5, batch_size=8)
            assert generate(module, env_config, prompts, **kwargs) == generate(module, env_config, prompts,
                                                                                decoder=False, **kwargs)
            engine = _DECODERS[module].cache.engine
            assert engine.capture
            graphs.append(set(engine.graphs))
            with torch.no_grad():
                module.lm.base_model.h[0].mlp.c_fc.weight.mul_(1.05)
    assert all(g == graphs[1] for g in graphs[1:]), graphs  # the first call prefills eagerly, the next in a graph
    assert any(name[0] == "steps" for name in graphs[0]) and counter.replays > 0


def test_a_decoder_keeps_the_graphs_of_its_last_sampling_settings_only():
    """Each (temperature, top_p) captures its own graphs (the values inside them); a decoder that
    meets more settings than SAMPLING_SETTINGS_KEPT (a replica serving one request at a time)
    drops the oldest one's graphs, and a setting met again is captured again and decodes the same."""
    from agents.modules.decoding import SAMPLING_SETTINGS_KEPT
    from benchmarks.emulated_capture import emulate_capture

    module = build_module("sampler.name=top_k", "sampler.k=3")
    env_config = dict(module.model_config["env"])
    temperatures = [0.5, 0.7, 0.9, 1.1, 1.3, 1.5]
    with emulate_capture():
        first = [generate(module, env_config, [None] * 4, seed=1, temperature=t) for t in temperatures]
        graphs = _DECODERS[module].cache.engine.graphs
        held = {name[-1][2] for name in graphs if isinstance(name[-1], tuple) and name[-1][0] == "sample"}
        assert held == set(temperatures[-SAMPLING_SETTINGS_KEPT:])
        assert generate(module, env_config, [None] * 4, seed=1, temperature=0.5) == first[0]
        assert generate(module, env_config, [None] * 4, seed=1, temperature=0.5, decoder=False) == first[0]


def test_generate_refuses_a_temperature_too_small_to_divide_by():
    module = build_module()
    env_config = dict(module.model_config["env"])
    for bad in (0.0, 1e-40, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"^generate: temperature must be >= 1e-05 \(use greedy=True for argmax\)"):
            generate(module, env_config, [None], seed=1, temperature=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decodes_on_cuda_replay_their_graphs_and_equal_the_eager_ones():
    """On a GPU `generate` replays the decoder's captured blocks: sampled and greedy results equal
    an eager decoder's (the same module, capture off) and no graph is captured after the first calls."""
    from agents.modules.decoding import Decoder

    module = build_module("sampler.name=top_k", "sampler.k=3").cuda()
    env_config = dict(module.model_config["env"])
    eager = Decoder()
    eager.cache.capture = False
    graphs = []
    for i, prompts in enumerate([[None] * 3, [None] * 5, ["3 7 12", None]] * 2):
        for greedy in (False, True):
            kwargs = dict(seed=i, greedy=greedy, temperature=1.5, batch_size=8)
            captured = generate(module, env_config, prompts, **kwargs)
            _DECODERS[module], mine = eager, _DECODERS[module]
            assert captured == generate(module, env_config, prompts, **kwargs)
            _DECODERS[module] = mine
        graphs.append(set(mine.cache.engine.graphs))
        assert mine.cache.engine.capture
    assert graphs[-1] == graphs[1] and any(name[0] == "steps" for name in graphs[-1]), graphs


def test_a_policy_decoding_in_bf16_takes_the_engine_in_bf16_and_equals_one_call_per_token():
    """`decode_in(module, "bf16")` (generate and serve --precision bf16): the weights, the decode
    engine's ring and the decodes in bf16, the decoder's results equal to one call per token's in
    bf16; each row's reward and lengths as in fp32's bounds."""
    from agents.generate import check_precision, decode_in

    module = decode_in(eos_likely(build_module("sampler.name=top_k", "sampler.k=5")), "bf16")
    assert {p.dtype for p in module.parameters() if p.is_floating_point()} == {torch.bfloat16}
    env_config = dict(module.model_config["env"])
    for greedy in (True, False):
        kwargs = dict(greedy=greedy, seed=4, temperature=1.5, batch_size=6)
        decoded = generate(module, env_config, PROMPTS, **kwargs)
        assert decoded == generate(module, env_config, PROMPTS, decoder=False, **kwargs)
        assert all(1 <= r["num_generated"] <= env_config["max_new_tokens"] and r["reward"] is not None
                   for r in decoded)
    assert _DECODERS[module].cache.engine.dtype == torch.bfloat16
    assert check_precision("bf16", "cpu") is None and check_precision("fp16", "cpu").startswith("--precision:")
