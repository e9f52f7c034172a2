"""Continuous batching in a replica (agents/serve/batching.py) and what rests on it: streaming,
stop strings, per-request sampling, the queue bound, cancellation, and the chat route.

The batcher is driven in-process on the quickstart's tiny policy; `Batcher.on_step` (called in
the batch's thread after each block) pauses it where a test must see the state between blocks.
The OpenAI client against a running server is in tests/test_serve_openai.py.
"""
import json
import threading
import time

import pytest
import torch

from agents.serve.batching import Batcher, Busy, Completion, Job, held_back, stop_position
from tests.conftest import QUICKSTART, served_in_process


def build_module(*overrides: str):
    from agents.config import algorithm_config, load
    from env.text_env import TokenGenerationEnv

    algo_config = algorithm_config(load(QUICKSTART, list(overrides)))
    module = algo_config.get_rl_module_spec(env=TokenGenerationEnv(algo_config.env_config)).build()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # away from the initial weights: a peaked, prompt-dependent policy
        for p in module.lm.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    module.eval()
    return module


@pytest.fixture(scope="module", params=["top_k", "mirostat"])
def module(request):
    """The quickstart's policy with a logits-only sampler (top-3) or a stateful one (mirostat, whose
    per-row state must follow each row)."""
    if request.param == "top_k":
        return build_module("sampler.name=top_k", "sampler.k=3")
    return build_module("sampler.name=mirostat", "sampler.tau=3.0", "sampler.learning_rate=0.5")


def mix() -> list[Completion]:
    """Completions that differ in every per-request setting."""
    out = [Completion("3 7 12", seed, 20, temperature=t, top_p=p)
           for seed, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.5, 1.0), (1.0, 0.5), (0.3, 1.0)])]
    out += [Completion("1 2", 50, 8, greedy=True), Completion("5", 51, 20, stop=("1",)),
            Completion("40 41 42 43 44 45 46", 52, 12), Completion("3 7 12", 0, 5),
            Completion("3 7 12", 0, 20, sampler=(("name", "mirostat"), ("tau", 2.0), ("learning_rate", 0.5))),
            Completion("3 7 12", 0, 20, sampler=(("name", "typical"), ("p", 0.5)))]
    return out


def run_alone(batcher, completions):
    return [batcher.submit(Job([c])).wait(timeout=60)[0] for c in completions]


def test_a_completion_gets_the_same_text_alone_and_among_others_joining_at_any_step(module):
    env_config = dict(module.model_config["env"])
    batcher = Batcher(module, env_config, rows=4, max_queue=64, block=3)  # rows join 3 steps apart
    completions = mix()
    alone = run_alone(batcher, completions)
    # all at once: 9 completions for 4 rows, so most wait and take rows others free
    jobs = [batcher.submit(Job([c])) for c in completions]
    together = [j.wait(timeout=60)[0] for j in jobs]
    assert together == alone
    # staggered: half now, the rest while those are mid-generation (after their first and second
    # blocks: steps 3 and 6, or 1 and 2 where a row requesting mirostat steps one token per call)
    late = {1: completions[::2], 2: completions[1::2]}
    late_jobs = []

    def submit_late():
        for c in late.pop(batcher.stats["blocks"] - start, []):
            late_jobs.append((c, batcher.submit(Job([c]))))

    start = batcher.stats["blocks"]
    first = [batcher.submit(Job([c])) for c in completions[:3]]
    batcher.on_step = submit_late
    try:
        assert [j.wait(timeout=60)[0] for j in first] == alone[:3]
        for _ in range(100):
            if not late:
                break
            threading.Event().wait(0.05)
        assert not late, "the batch stopped before every late completion was submitted"
        for c, job in late_jobs:
            assert job.wait(timeout=60)[0] == alone[completions.index(c)]
    finally:
        batcher.on_step = None
    assert batcher.load()["max_active"] == 4 and batcher.load()["active"] == 0

    # what the settings do: a length cap ends in "length" at it, EOS or a stop string in "stop"
    for c, r in zip(completions, alone):
        assert 1 <= r["num_generated"] <= c.max_tokens
        if r["finish_reason"] == "length":
            assert r["num_generated"] == c.max_tokens
        assert r["prompt_tokens"] == min(len(c.prompt.split()), 5) and r["reward"] is None  # cut to max_prompt_len
    assert alone[8]["text"].split() == alone[0]["text"].split()[:5]  # the same row, cut at 5 tokens
    # a requested sampler changes the text; top-k with k = 1 is argmax
    assert alone[9]["text"] != alone[0]["text"] and alone[10]["text"] != alone[0]["text"]
    k1, argmax = run_alone(batcher, [Completion("3 7", 4, 20, sampler=(("name", "top_k"), ("k", 1))),
                                     Completion("3 7", 4, 20, greedy=True)])
    assert k1["text"] == argmax["text"]
    assert len({r["text"] for r in alone[:5]}) == 5  # the sampling settings change the text
    stopped, unstopped = alone[6], run_alone(batcher, [Completion("5", 51, 20)])[0]
    cut = unstopped["text"].find("1")
    assert cut >= 0, unstopped  # the stop string occurs in this seed's text, so the test can see the cut
    assert stopped["text"] == unstopped["text"][:cut] and stopped["finish_reason"] == "stop"
    batcher.close()


def test_rows_write_what_generate_writes_in_the_env_greedy_or_sampled(module):
    """The batch keeps each row's window as the env's observation would be (its own update, not
    env.step), and draws as `agents.generate.generate` does (one uniform per token from the
    completion's generator): greedy and sampled completions, at any temperature and top_p, equal
    the one-at-a-time path's, which steps real envs, so a seed gives one text either way."""
    from agents.serve.replica import alone_results

    env_config = dict(module.model_config["env"])
    batcher = Batcher(module, env_config, rows=3)
    prompts = ["3 7 12", "1 2", "40 41 42 43 44 45 46", "5", "9 9"]
    completions = [Completion(p, 0, 20, greedy=True) for p in prompts]
    completions += [Completion(p, 10 + i, 20, temperature=t, top_p=q)
                    for i, (p, (t, q)) in enumerate(zip(prompts, [(1.0, 1.0), (0.7, 0.9), (1.5, 1.0), (1.0, 0.5),
                                                                  (2.0, 1.0)]))]
    batched = [j.wait(timeout=60)[0] for j in [batcher.submit(Job([c])) for c in completions]]
    for c, got in zip(completions, batched):
        want = alone_results(module, env_config, [c])[0]
        assert {k: got[k] for k in want} == want
    assert len({r["text"] for r in batched[:5]}) > 1
    # the sampled ones are draws, not the greedy texts
    assert sum(s["text"] != g["text"] for s, g in zip(batched[5:], batched[:5])) >= 3
    batcher.close()


def test_stop_strings_are_held_back_from_a_stream_until_they_cannot_begin_one():
    assert stop_position("12 13 14", ("13", "4")) == 3 and stop_position("12", ("3",)) is None
    assert held_back("12 1", ("13",)) == 1 and held_back("12 ", (" 13",)) == 1 and held_back("12", ("5",)) == 0
    assert held_back("ab", ("abc", "b")) == 2


def test_streamed_deltas_add_up_to_the_text_and_never_show_a_stop_string():
    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=3)
    for c in [Completion("3 7 12", 0, 20), Completion("5", 51, 20, stop=("1",)), Completion("5", 51, 20, stop=(" 4",))]:
        job = batcher.submit(Job([c], stream=True))
        deltas, finish = [], None
        while finish is None:
            kind, index, value = job._events.get(timeout=60)
            assert index == 0
            if kind == "delta":
                assert value and finish is None
                deltas.append(value)
                assert not any(s in "".join(deltas) for s in c.stop)
            else:
                assert kind == "finish"
                finish = value
        assert job._events.get(timeout=60)[0] == "done"
        assert "".join(deltas) == finish["text"] and len(deltas) > 1
    batcher.close()


def test_a_full_queue_refuses_at_once_and_every_accepted_request_is_answered():
    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=2, max_queue=2)
    with batcher.cv:  # the batch cannot take anything from the queue meanwhile
        accepted = [batcher.submit(Job([Completion("3", 0, 4), Completion("3", 1, 4)])),  # the 2 rows
                    batcher.submit(Job([Completion("3", 2, 4)])), batcher.submit(Job([Completion("3", 3, 4)]))]
        # the 2 rows take the first job's completions at the next block: the other 2 wait
        assert batcher.load()["waiting"] == 2
        with pytest.raises(Busy, match=r"^server busy: 2 completions are waiting for one of the 2 rows, and this request's 1 would pass "
                                   r"--max-queue 2; retry later$"):
            batcher.submit(Job([Completion("3", 4, 4)]))
    assert [len(j.wait(timeout=60)) for j in accepted] == [2, 1, 1]
    load = batcher.load()
    assert load["refused"] == 1 and load["completions"] == 4 and load["waiting"] == 0
    batcher.submit(Job([Completion("3", 4, 4)])).wait(timeout=60)  # room again
    batcher.close()


def test_a_cancelled_job_frees_its_row_and_drops_its_waiting_completions_at_the_next_step():
    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=1)
    paused, go = threading.Event(), threading.Event()

    def pause():
        paused.set()
        go.wait(timeout=60)

    batcher.on_step = pause
    job = batcher.submit(Job([Completion("3", s, 20) for s in range(3)], stream=True))
    assert paused.wait(timeout=60)  # one block done: its token of the first completion
    job.cancel()
    batcher.on_step = None
    go.set()
    other = batcher.submit(Job([Completion("3 7", 9, 3)])).wait(timeout=60)  # the row is free for it
    assert other[0]["num_generated"] == 3
    load = batcher.load()
    assert load["cancelled"] == 3 and load["active"] == 0 and load["waiting"] == 0
    # the cancelled row wrote one block, then stopped: one step (it streams and joined an idle replica)
    assert load["tokens"] == 1 + 3
    assert job.results == [None, None, None]
    batcher.close()


def test_a_reward_that_fails_fails_its_own_request_and_no_other(monkeypatch):
    """A scored completion whose reward raises (a non-finite score, a scorer's error): its job gets
    one error line and frees its rows; the request beside it and one waiting in the queue are
    answered (before: that job never finished, and every other job got "internal error")."""
    import agents.serve.scoring as scoring

    real = scoring.score

    def score(scorers, env_config, c, prompt, text):
        if c.seed == 666:
            raise ValueError("task 'x': the reward is nan for generation '...'")
        return real(scorers, env_config, c, prompt, text)

    monkeypatch.setattr(scoring, "score", score)
    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=2, max_queue=8, block=2)
    with batcher.cv:  # all three in before the batch starts: the bad one (2 completions), one beside, one queued
        bad = batcher.submit(Job([Completion("3 7 12", 666, 3, meta={}), Completion("3 7 12", 666, 20, meta={})],
                                 stream=True))
        beside, queued = batcher.submit(Job([Completion("1 2", 1, 6)])), batcher.submit(Job([Completion("5", 2, 4)]))
    with pytest.raises(RuntimeError, match=r"^reward: ValueError: task 'x': the reward is nan for generation"):
        bad.wait(timeout=60)
    assert beside.wait(timeout=60)[0]["num_generated"] >= 1 and queued.wait(timeout=60)[0]["num_generated"] >= 1
    load = batcher.load()
    assert load["active"] == 0 and load["waiting"] == 0
    # its other completion freed its row, and sent nothing after; both count as failed, neither as done or cancelled
    assert (load["failed"], load["cancelled"], load["completions"]) == (2, 0, 2) and bad._events.empty(), load
    batcher.close()


def test_a_slow_reward_does_not_stall_the_rows_of_other_requests(monkeypatch):
    """A scored completion's reward (a classifier, say) runs in a thread of its own: while it
    runs, other requests' rows go on and are answered (before: every row waited for it), and the
    scored request gets its reward after."""
    import agents.serve.scoring as scoring

    real, scoring_started, release = scoring.score, threading.Event(), threading.Event()

    def score(scorers, env_config, c, prompt, text):
        scoring_started.set()
        assert release.wait(timeout=60)
        return real(scorers, env_config, c, prompt, text)

    monkeypatch.setattr(scoring, "score", score)
    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=2, block=2)
    try:
        scored = batcher.submit(Job([Completion("3 7 12", 0, 2, meta={})]))
        assert scoring_started.wait(timeout=60)
        other = batcher.submit(Job([Completion("1 2", 1, 12)])).wait(timeout=30)  # answered meanwhile
        assert other[0]["num_generated"] >= 1 and scored.results == [None]
    finally:
        release.set()
    (result,) = scored.wait(timeout=60)
    assert result["reward"] is not None and batcher.load()["completions"] == 2
    batcher.close()


def until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_rewards_wait_for_a_graph_capture_and_a_closing_replica_fails_the_ones_queued():
    """A reward runs under the decode engine's CAPTURE_LOCK (on a GPU no other thread's CUDA work
    may run while a graph is captured): held, the reward waits and `load` counts it as scoring.
    Closing the replica fails the rewards still queued (before: their requests never finished)."""
    from agents.modules.decode_engine import CAPTURE_LOCK

    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=2, block=2)
    with CAPTURE_LOCK:  # a capture under way
        first, second = (batcher.submit(Job([Completion("3 7 12", s, 2, meta={})])) for s in (0, 1))
        with pytest.raises(TimeoutError):
            first.wait(timeout=2)
        load = batcher.load()
        assert (load["scoring"], load["completions"], load["active"]) == (2, 0, 0), load
        batcher.close()  # the second is still queued: it fails; the first is being scored
    with pytest.raises(RuntimeError, match=r"^the server closed before its reward was computed$"):
        second.wait(timeout=60)
    assert first.wait(timeout=60)[0]["reward"] is not None
    load = batcher.load()
    assert (load["scoring"], load["completions"], load["failed"]) == (0, 1, 1), load


def test_a_completion_being_scored_when_the_batch_fails_counts_as_failed(monkeypatch):
    """A request whose first completion is being scored when the batch fails: it gets the batch's
    error alone, and that completion counts as failed, not as done (before: done)."""
    import agents.serve.batching as batching
    from agents.modules.decode_engine import CAPTURE_LOCK

    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=2, block=1)
    real, fail = batching.next_tokens, threading.Event()
    monkeypatch.setattr(batching, "next_tokens", lambda *args: (_ for _ in ()).throw(RuntimeError("boom"))
                        if fail.is_set() else real(*args))
    with CAPTURE_LOCK:  # the first completion's reward waits
        job = batcher.submit(Job([Completion("3 7 12", 0, 2, meta={}), Completion("3 7 12", 1, 20, meta={})]))
        until(lambda: batcher.load()["scoring"] == 1)
        fail.set()
        with pytest.raises(RuntimeError, match=r"^internal error: RuntimeError: boom$"):
            job.wait(timeout=60)
    until(lambda: batcher.load()["scoring"] == 0)
    load = batcher.load()
    assert (load["failed"], load["completions"]) == (2, 0), load
    batcher.close()


def streamed(tokenizer, ids: list) -> tuple[list, dict]:
    """A streamed completion that writes the tokens `ids` (through `tokenizer`) one step at a
    time: its deltas and its result."""
    import agents.serve.batching as batching

    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=1, block=1)
    assert batcher.eos_id not in ids
    batcher.tokenizer = tokenizer
    written = iter(ids)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batching, "next_tokens", lambda *args: torch.tensor([[next(written)]]))
        job = batcher.submit(Job([Completion("3 7 12", 0, len(ids))], stream=True))
        deltas, finish = [], None
        while finish is None:
            kind, _, value = job._events.get(timeout=60)
            if kind == "delta":
                deltas.append(value)
            else:
                finish = value
    batcher.close()
    return deltas, finish


def test_a_stream_holds_back_a_character_whose_bytes_are_not_all_written():
    """A byte-level BPE tokenizer (GPT-2's kind) writes 'é' and '😀' over several tokens, and decodes
    a character cut between them as U+FFFD: the stream sends no U+FFFD, goes on after the
    character is whole, and its deltas add up to the text (before: it sent the U+FFFD and stopped)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["abc"], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    ids = tokenizer("ok é😀 done", add_special_tokens=False)["input_ids"]
    assert "\ufffd" in tokenizer.decode(ids[:4])  # 'é' is two byte tokens here
    deltas, finish = streamed(tokenizer, ids)
    assert "".join(deltas) == finish["text"] == "ok é😀 done" and not any("\ufffd" in d for d in deltas), deltas


def test_a_row_keeps_its_text_while_rows_join_and_leave_around_it(module):
    """A completion running alone (one row stepped) while others join in the rows after it (2,
    then 4 rows stepped) and end before it (back to 1): its text is the one it gets alone, with
    the policy's own stateful sampler (mirostat's mu per row) carried across (before: a
    change in the rows stepped started every row's mu over)."""
    batcher = Batcher(module, dict(module.model_config["env"]), rows=4, block=1)
    a, late = Completion("3 7 12", 5, 20), {3: Completion("1 2", 9, 15), 6: Completion("5", 3, 4)}
    alone = run_alone(batcher, [a, *late.values()])
    start, jobs = batcher.stats["blocks"], []

    def join():
        if batcher.stats["blocks"] - start in late and len(jobs) < 3:
            jobs.append(batcher.submit(Job([late[batcher.stats["blocks"] - start]])))

    batcher.on_step = join
    jobs.insert(0, batcher.submit(Job([a])))
    results = [jobs[0].wait(timeout=60)[0]]
    batcher.on_step = None
    results += [j.wait(timeout=60)[0] for j in jobs[1:]]
    assert len(results) == 3 and [r["text"] for r in results] == [r["text"] for r in alone]
    assert results[0]["num_generated"] > 3 + results[1]["num_generated"]  # it ran on after the others ended
    batcher.close()


def test_a_lone_request_steps_one_row_of_the_batch():
    """A replica of 8 rows serving one request steps one row (the first 1, 2, 4 or 8 rows that hold
    the rows in use; before: all 8), and rows that join later take the rows after it with the texts
    they get alone (the engine keeps every row's keys and values)."""
    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=8, block=4)
    stats = module.kv_cache.stats
    alone = batcher.submit(Job([Completion("3 7 12", 5, 12)])).wait(timeout=60)[0]
    steps = batcher.load()["steps"]
    assert (stats["prefill_rows"], stats["incremental_rows"]) == (1, steps - 1), (stats, steps)
    with batcher.cv:  # five together: rows 0-4, stepped as the first 8
        jobs = [batcher.submit(Job([Completion("3 7 12", 5, 12)]))] + [
            batcher.submit(Job([Completion("1 2", s, 6 + s)])) for s in range(4)]
    together = [j.wait(timeout=60)[0] for j in jobs]
    assert together[0]["text"] == alone["text"]
    assert [r["text"] for r in together[1:]] == [r["text"] for r in run_alone(batcher, [Completion("1 2", s, 6 + s)
                                                                                       for s in range(4)])]
    batcher.close()
    assert batcher.load()["scoring"] == 0  # none was scored: closing leaves none waiting for a reward


def test_a_stream_through_a_tokenizer_that_cleans_up_spaces_sends_the_text_it_ends_with():
    """A tokenizer that cleans up spaces in the decoded text (`clean_up_tokenization_spaces`, as
    BERT's kind may) decodes "don '" + "t" as "don't": text already streamed would change. The
    stream holds back the last space and word until the next token, and its deltas add up to the
    text (before: the stream stopped at "I don '" and never sent the rest)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "I", "don", "'", "t", "go", ",", "ok", ".", "yes"]
    wordpiece = Tokenizer(models.WordPiece({w: 100 + i for i, w in enumerate(words)}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer, wordpiece.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    ids = tokenizer("I don't go, ok. yes", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[:3]) == "I don '" and tokenizer.decode(ids) == "I don't go, ok. yes"
    deltas, finish = streamed(tokenizer, ids)
    assert "".join(deltas) == finish["text"] == "I don't go, ok. yes", deltas
    assert deltas == ["I", " don", "'t", " go,", " ok. yes"]  # each word once the next one began; the rest at the end


def test_completions_starting_in_rows_count_against_the_queue_bound_and_each_unfinished_one_is_counted():
    """Completions taken from the queue whose rows are still being started hold those rows: a
    submit meanwhile sees no open row (before: up to `rows` more completions were accepted past
    --max-queue), and `load` shows them in use. A job cancelled then starts no more completions,
    each counted as cancelled (before: the ones not started were counted nowhere)."""
    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=2, max_queue=1, block=2)
    entered, release, reset = threading.Event(), threading.Event(), batcher.env.reset

    def slow_reset(*args, **kwargs):  # the first row's start takes a while
        entered.set()
        release.wait(timeout=60)
        return reset(*args, **kwargs)

    batcher.env.reset = slow_reset
    first = batcher.submit(Job([Completion("3", 0, 6), Completion("3", 1, 6)]))
    assert entered.wait(timeout=60)
    queued = batcher.submit(Job([Completion("3 7", 2, 4)]))  # the one completion --max-queue 1 lets wait
    load = batcher.load()
    assert (load["active"], load["waiting"]) == (2, 1), load
    with pytest.raises(Busy, match=r"^server busy: 1 completions are waiting for one of the 2 rows"):
        batcher.submit(Job([Completion("3 7", 3, 4)]))
    first.cancel()
    batcher.env.reset = reset
    release.set()
    assert queued.wait(timeout=60)[0]["num_generated"] >= 1
    load = batcher.load()
    assert (load["cancelled"], load["completions"], load["refused"], load["active"], load["waiting"]) == (2, 1, 1, 0, 0), load
    batcher.close()


def test_every_completion_a_failed_batch_or_a_refused_prompt_held_counts_as_failed():
    """A batch that fails fails every completion it holds (in rows and waiting), and a prompt
    refused at its row's start fails its request's completions: `load`'s `failed` counts each
    (before: none of them), and the batch serves the next request."""
    import agents.serve.batching as batching

    module = build_module()
    batcher = Batcher(module, dict(module.model_config["env"]), rows=1, max_queue=8)
    reset = batcher.env.reset

    def refusing_reset(*args, options, **kwargs):
        if options["prompt"] == "refused":
            raise ValueError("the prompt is refused")
        return reset(*args, options=options, **kwargs)

    batcher.env.reset = refusing_reset
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(batching, "next_tokens", lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
        with batcher.cv:  # both in before the batch starts: one in the row, two waiting
            jobs = [batcher.submit(Job([Completion("3", 0, 4)])), batcher.submit(Job([Completion("3", 1, 4)] * 2))]
        for job in jobs:
            with pytest.raises(RuntimeError, match=r"^internal error: RuntimeError: boom$"):
                job.wait(timeout=60)
    assert batcher.load()["failed"] == 3
    refused = batcher.submit(Job([Completion("refused", 0, 4), Completion("3", 1, 4)]))
    with pytest.raises(RuntimeError, match=r"^prompt: the prompt is refused$"):
        refused.wait(timeout=60)
    assert batcher.submit(Job([Completion("3", 2, 4)])).wait(timeout=60)[0]["num_generated"] >= 1
    load = batcher.load()
    assert (load["failed"], load["completions"], load["active"], load["waiting"]) == (5, 1, 0, 0), load
    batcher.close()


# -- the routes over HTTP, in-process ---------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from agents.saved_policy import MODULE_SUBDIR

    path = tmp_path_factory.mktemp("checkpoint")
    build_module().save_to_path(str(path / MODULE_SUBDIR))
    return str(path)


def events_of(response) -> list:
    """The server-sent events of a streamed reply: parsed JSON, or the string [DONE]."""
    out = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_a_streamed_completion_is_openais_chunks_with_the_text_of_the_whole_reply(checkpoint):
    from agents.serve import Policy

    policy = Policy(checkpoint, max_samples=4)
    body = {"prompt": ["3 7", "5"], "n": 2, "max_tokens": 12, "seed": 5, "stop": ["4"]}
    with served_in_process(policy) as client:
        whole = client.post("/v1/completions", json=body).json()
        with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = events_of(r)
        # choice k draws with seed + k (docs/serving.md): choice 2 is prompt "5"'s first at seed 7
        alone = client.post("/v1/completions", json={**body, "prompt": "5", "n": 1, "seed": 7}).json()
    assert alone["choices"][0]["text"] == whole["choices"][2]["text"]
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    texts, finish = {}, {}
    for e in events[:-2]:
        assert e["object"] == "text_completion" and e["id"] == events[0]["id"] and len(e["choices"]) == 1
        (choice,) = e["choices"]
        assert choice["index"] not in finish  # nothing after a choice's finish chunk
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert [texts[i] for i in range(4)] == [c["text"] for c in whole["choices"]]
    assert [finish[i] for i in range(4)] == [c["finish_reason"] for c in whole["choices"]]


def test_the_chat_route_answers_through_the_chat_template_and_refuses_without_one(checkpoint):
    from agents.serve import Policy

    policy = Policy(checkpoint, max_samples=4)
    messages = [{"role": "system", "content": "3"}, {"role": "user", "content": "7 12"}]
    with served_in_process(policy) as client:
        r = client.post("/v1/chat/completions", json={"messages": messages})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "no chat template" in error["message"]
        assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
        # a template that writes the contents one after another: the chat is the prompt "3 7 12"
        policy.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        policy.chat = True
        body = {"messages": messages, "max_tokens": 6, "seed": 2, "n": 2}
        chat = client.post("/v1/chat/completions", json=body).json()
        plain = client.post("/v1/completions", json={"prompt": "3 7 12", "max_tokens": 6, "seed": 2, "n": 2}).json()
        assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
        assert [c["message"] for c in chat["choices"]] == [{"role": "assistant", "content": c["text"]}
                                                           for c in plain["choices"]]
        assert chat["usage"] == plain["usage"]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = events_of(r)
        assert events[-1] == "[DONE]"
        content = {0: "", 1: ""}
        for e in events[:-1]:
            assert e["object"] == "chat.completion.chunk"
            delta = e["choices"][0]["delta"]
            assert set(delta) <= {"role", "content"} and delta.get("role", "assistant") == "assistant"
            content[e["choices"][0]["index"]] += delta.get("content", "")
        assert [content[0], content[1]] == [c["message"]["content"] for c in chat["choices"]]
        for bad, field in [({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "3"}]},
                                                               "messages"),
                           ({"messages": messages, "max_tokens": 2, "max_completion_tokens": 2},
                            "max_completion_tokens"), ({"messages": messages, "prompt": "3"}, "prompt"),
                           ({"messages": [{"role": "user", "content": "three"}]}, "messages"),
                           ({"messages": messages, "sampler": {"name": "top_k"}}, "sampler"),
                           ({"messages": messages, "sampler": {"name": "top_k", "k": 0}}, "sampler"),
                           ({"messages": messages, "sampler": {"name": "typical", "k": 3}}, "sampler"),
                           ({"messages": messages, "sampler": {"name": "beam"}}, "sampler"),
                           ({"messages": messages, "sampler": "top_k"}, "sampler")]:
            r = client.post("/v1/chat/completions", json=bad)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field}:"), (bad, r.text)


def test_a_full_replica_answers_429_and_one_request_at_a_time_refuses_streaming(checkpoint):
    from agents.serve import Policy

    policy = Policy(checkpoint, batch_rows=1, max_queue=0)
    paused, go = threading.Event(), threading.Event()
    policy.batcher.on_step = lambda: (paused.set(), go.wait(timeout=60))
    with served_in_process(policy) as client:
        first = {}
        sender = threading.Thread(target=lambda: first.update(r=client.post("/v1/completions", json={
            "prompt": "3", "max_tokens": 20})))
        sender.start()
        assert paused.wait(timeout=60)  # the only row is taken (its first block written, more to come)
        r = client.post("/v1/completions", json={"prompt": "3"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
        assert r.json()["error"]["message"].startswith("server busy:")
        r = client.post("/generate", json={"prompt": "3"})
        assert r.status_code == 429 and r.json()["error"].startswith("server busy:"), r.text
        policy.batcher.on_step = None
        go.set()
        sender.join(timeout=60)
        assert first["r"].status_code == 200 and len(first["r"].json()["choices"]) == 1
    alone = Policy(checkpoint, batch_rows=0)
    with served_in_process(alone) as client:
        for field in ("stream", "stop"):
            r = client.post("/v1/completions", json={"prompt": "3", field: True if field == "stream" else "1"})
            assert r.status_code == 400 and "--batch-rows 0" in r.json()["error"]["message"], r.text
        assert client.post("/v1/completions", json={"prompt": "3", "max_tokens": 4}).status_code == 200
        assert client.get("/generate").json()["load"] is None


def test_a_streaming_client_that_goes_away_frees_its_row_at_once(checkpoint):
    from agents.serve import Policy

    policy = Policy(checkpoint, batch_rows=1)
    paused, go = threading.Event(), threading.Event()
    policy.batcher.on_step = lambda: (paused.set(), go.wait(timeout=60))
    with served_in_process(policy) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "3", "max_tokens": 20, "stream": True}) as r:
            assert paused.wait(timeout=60)  # the batch holds after its first block (its tokens' chunks)
            assert next(r.iter_lines()).startswith("data: ")
        row = policy.batcher.slots[0]  # still in its row: the batch is paused
        for _ in range(200):  # the server sees the client go and cancels the request
            if row.job.cancelled:
                break
            threading.Event().wait(0.05)
        assert row.job.cancelled
        policy.batcher.on_step = None
        go.set()
        for _ in range(200):
            load = client.get("/generate").json()["load"]
            if load["active"] == 0:
                break
            threading.Event().wait(0.05)
    # the row was freed at the next block boundary: one block written of the 20 tokens asked for (one
    # step: a streamed request that joined an idle replica)
    assert load["cancelled"] == 1 and load["completions"] == 0 and load["tokens"] == 1 and load["active"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_replica_on_a_gpu_writes_what_the_cpu_replica_writes(checkpoint):
    from agents.serve import Policy

    body = {"prompt": ["3 7", "5"], "n": 2, "max_tokens": 12, "temperature": 0}
    replies = []
    for device in ("cpu", "cuda"):
        with served_in_process(Policy(checkpoint, max_samples=4, device=device)) as client:
            replies.append(client.post("/v1/completions", json=body).json())
    assert [c["text"] for c in replies[1]["choices"]] == [c["text"] for c in replies[0]["choices"]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_replica_draws_sampled_completions_with_every_request_sampler_on_the_device(checkpoint):
    """The draws run where the logits are: sampled completions at several temperatures and top_p
    values, with a stateful request sampler (mirostat: its mu lives on the device) and stateless
    ones, are all answered, the same seed giving the same texts."""
    from agents.serve import Policy

    bodies = [{"prompt": ["3 7", "5"], "n": 2, "max_tokens": 12, "temperature": t, "top_p": p, "seed": 7}
              for t, p in [(1.0, 1.0), (0.7, 0.9), (1.5, 1.0)]]
    bodies += [{**bodies[0], "sampler": s} for s in [{"name": "mirostat", "tau": 3.0, "learning_rate": 0.1},
                                                      {"name": "typical", "p": 0.9}, {"name": "top_k", "k": 3}]]
    with served_in_process(Policy(checkpoint, max_samples=4, device="cuda")) as client:
        for body in bodies:
            first, again = (client.post("/v1/completions", json=body) for _ in range(2))
            assert first.status_code == 200, first.text
            choices = first.json()["choices"]
            assert len(choices) == 4 and all(c["finish_reason"] in ("stop", "length") for c in choices)
            assert [c["text"] for c in again.json()["choices"]] == [c["text"] for c in choices]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generate_on_a_gpu_draws_on_the_device_and_repeats_for_a_seed():
    """`agents.generate.generate` with the policy on a GPU (evaluation's and one-at-a-time serving's
    loop): the draws run on the device from each row's CPU generator; a seed repeats its texts."""
    from agents.generate import generate

    module = build_module("sampler.name=top_k", "sampler.k=3").to("cuda")
    env_config = dict(module.model_config["env"])
    prompts = ["3 7", "5", "40 41 42", None]
    runs = [generate(module, env_config, prompts, seed=3, temperature=0.8, top_p=0.9) for _ in range(2)]
    assert [r["generation"] for r in runs[0]] == [r["generation"] for r in runs[1]]
    assert all(1 <= r["num_generated"] <= env_config["max_new_tokens"] for r in runs[0])
