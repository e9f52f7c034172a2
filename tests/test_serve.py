"""Export of a policy to a plain transformers directory, and serving it over HTTP.

The checkpoint is the quickstart's policy (built as `agents.train` builds it, with a
top-3 truncation sampler so the configured sampler is visible in what the server
writes), its weights moved off their initial values, saved where a training
checkpoint keeps it. The server runs as users run it, `python -m agents.serve`
(`agents.serve.launch.ServeProcess`), in its own process group on a free loopback port,
and is stopped with Ctrl-C (SIGINT) like a user stops it; the group is SIGKILLed
afterwards whatever happened.
"""
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from agents.serve.launch import ServeProcess, free_port
from tests.conftest import QUICKSTART, ROOT, assert_refused_lightly, served_in_process
from tests.conftest import run_module as run

TOP_K = 3
TOL = 1e-4  # logits of the served (KV-cached) and exported (full) forward passes agree to float error


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from agents.config import algorithm_config, load
    from agents.saved_policy import MODULE_SUBDIR
    from env.text_env import TokenGenerationEnv

    cfg = load(QUICKSTART, ["sampler.name=top_k", f"sampler.k={TOP_K}"])
    algo_config = algorithm_config(cfg)
    module = algo_config.get_rl_module_spec(env=TokenGenerationEnv(algo_config.env_config)).build()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights no fresh model has: an export that loses them cannot pass
        for p in module.lm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("checkpoint")
    module.save_to_path(str(path / MODULE_SUBDIR))
    return str(path)


@pytest.fixture(scope="module")
def policy(checkpoint):
    from agents.generate import load_policy

    return load_policy(checkpoint)


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    """The CLI's export of the checkpoint, loaded back with transformers alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("export") / "model"
    result = run("agents.export", "--checkpoint", checkpoint, "--out", str(out), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert str(out) in result.stdout
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    return out, model, tokenizer


# -- export -------------------------------------------------------------------------------


def test_exported_model_gives_the_policys_logits_and_its_tokenizer_round_trips(exported, policy):
    out, model, tokenizer = exported
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(os.listdir(out))
    text = "3 7 12 49 0"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == policy.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == policy.tokenizer.eos_token_id
    assert tokenizer.pad_token_id == policy.tokenizer.pad_token_id

    batch = torch.tensor([ids, list(reversed(ids))])
    with torch.no_grad():
        want = policy.lm(input_ids=batch).logits
        got = model(input_ids=batch).logits
    assert got.shape == (2, len(ids), len(policy.tokenizer))
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
    # the weights are the checkpoint's, not a fresh initialisation
    fresh = type(model)(model.config).eval()
    with torch.no_grad():
        assert not torch.allclose(fresh(input_ids=batch).logits, want, atol=1e-3)
    # the configured sampler travels as the generation config
    assert model.generation_config.do_sample is True and model.generation_config.top_k == TOP_K


def test_export_refuses_a_path_without_a_policy_and_a_non_empty_out_dir(checkpoint, tmp_path):
    from agents.export import export_policy

    missing = run("agents.export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "a"), timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith("error: --checkpoint:") and "no policy" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists()

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me")
    busy = run("agents.export", "--checkpoint", checkpoint, "--out", str(taken), timeout=120)
    assert busy.returncode == 2
    assert busy.stderr.strip().startswith("error: --out:") and "--force" in busy.stderr
    assert len(busy.stderr.strip().splitlines()) == 1
    assert os.listdir(taken) == ["notes.txt"]

    export_policy(checkpoint, str(taken), force=True)  # what --force does
    assert {"notes.txt", "config.json", "tokenizer.json"} <= set(os.listdir(taken))


# -- the HTTP application in-process (FastAPI's TestClient, no Ray) ---------------------------

MAX_SAMPLES = 8
EOS_BIAS = 0.25  # in-process only: about half the sampled completions below end on EOS, half run to length


@pytest.fixture(scope="module")
def client(checkpoint):
    """The served FastAPI app in this process, answering with a `Policy` of the checkpoint whose
    LM never writes <pad> (so a completion's text shows every token it wrote but EOS) and writes
    EOS more often (so both finish reasons occur)."""
    from agents.serve import Policy

    local = Policy(checkpoint, max_samples=MAX_SAMPLES)
    tok = local.tokenizer
    head = local.module.lm.get_output_embeddings()
    bias = torch.zeros(head.out_features)
    bias[[t for t in tok.all_special_ids if t != tok.eos_token_id]] = -1e4
    bias[tok.eos_token_id] = EOS_BIAS
    head.bias = torch.nn.Parameter(bias, requires_grad=False)
    with served_in_process(local) as test_client:
        test_client.policy = local
        yield test_client


def call(client, route: str, body, content_type="application/json"):
    """(status, JSON reply) of a POST; `body` is JSON-encoded unless it is bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post(route, content=data, headers={"Content-Type": content_type} if content_type else {})
    return response.status_code, response.json()


def error_message(reply: dict) -> str:
    """A refused request's one line: /generate's `error` string, or the message of OpenAI's error
    object (the /v1/ routes), whose `param` names the same field."""
    assert set(reply) == {"error"}, reply
    error = reply["error"]
    if isinstance(error, str):
        return error
    assert set(error) == {"message", "type", "param", "code"}, error
    field = error["message"].split(":", 1)[0]
    assert error["param"] == (None if field in ("request body", "internal error", "path", "method", "server busy")
                              else field), error
    return error["message"]


def assert_field_error(status, reply, field, want_status=400, context=None):
    assert status == want_status, (context, status, reply)
    message = error_message(reply)
    assert message.startswith(f"{field}:"), (context, reply)
    assert "\n" not in message and "Traceback" not in message, reply


BAD_GENERATE = [  # (body, the field the error names)
    (b"{not json", "request body"), (b"\xff", "request body"), (b"[\"3 7\"]", "request body"), (b"", "request body"),
    ({"max_new_tokens": 5}, "prompt"), ({"prompt": None}, "prompt"), ({"prompt": 42}, "prompt"),
    ({"prompt": ["3"]}, "prompt"), ({"prompt": "three"}, "prompt"),  # not a word of the task's vocabulary
    ({"prompt": ""}, "prompt"), ({"prompt": " "}, "prompt"), ({"prompt": "3" * 10_001}, "prompt"),
    ({"prompt": "3", "max_new_tokens": 0}, "max_new_tokens"), ({"prompt": "3", "max_new_tokens": 21}, "max_new_tokens"),
    ({"prompt": "3", "max_new_tokens": True}, "max_new_tokens"), ({"prompt": "3", "max_new_tokens": 2.5}, "max_new_tokens"),
    ({"prompt": "3", "max_new_tokens": "5"}, "max_new_tokens"), ({"prompt": "3", "num_samples": MAX_SAMPLES + 1}, "num_samples"),
    ({"prompt": "3", "greedy": "yes"}, "greedy"), ({"prompt": "3", "greedy": 1}, "greedy"),
    ({"prompt": "3", "seed": -1}, "seed"), ({"prompt": "3", "seed": "7"}, "seed"), ({"prompt": "3", "seed": 2**31}, "seed"),
    ({"prompt": "3", "references": []}, "references"),
    ({"prompt": "3", "max_tokens": 5}, "max_tokens"), ({"prompt": "3", "temperature": 0.5}, "temperature"),
    (b'{"prompt": "3 \\ud83d"}', "prompt"),  # half an emoji's escape: not Unicode text (a 500 before)
]
BAD_COMPLETIONS = [
    (b"{", "request body"), (b"7", "request body"), ({"max_tokens": 3}, "prompt"), ({"prompt": 3}, "prompt"),
    ({"prompt": []}, "prompt"), ({"prompt": [3, 7]}, "prompt"), ({"prompt": ["3", "three"]}, "prompt"),
    ({"prompt": ["3", ""]}, "prompt"), ({"prompt": ["3"] * 3, "n": 3}, "prompt"),  # 9 completions > --max-samples
    ({"prompt": "3", "max_tokens": 0}, "max_tokens"), ({"prompt": "3", "max_tokens": 21}, "max_tokens"),
    ({"prompt": "3", "max_tokens": "4"}, "max_tokens"), ({"prompt": "3", "n": 0}, "n"),
    ({"prompt": "3", "n": MAX_SAMPLES + 1}, "n"), ({"prompt": "3", "temperature": -0.1}, "temperature"),
    ({"prompt": "3", "temperature": 2.5}, "temperature"), ({"prompt": "3", "temperature": "hot"}, "temperature"),
    ({"prompt": "3", "top_p": 0}, "top_p"), ({"prompt": "3", "top_p": 1.5}, "top_p"), ({"prompt": "3", "seed": 1.5}, "seed"),
    ({"prompt": "3", "model": 7}, "model"), ({"prompt": "3", "stream": "yes"}, "stream"),
    (b'{"prompt": "3", "model": "\\ud800"}', "model"), (b'{"prompt": ["3", "\\udc00 7"]}', "prompt.1"),
    ({"prompt": "3", "logprobs": 1}, "logprobs"), ({"prompt": "3", "stop": []}, "stop"),
    ({"prompt": "3", "stop": ["1", "2", "3", "4", "5"]}, "stop"), ({"prompt": "3", "stop": [""]}, "stop"),
    ({"prompt": "3", "stream_options": {"usage": True}}, "stream_options"), ({"prompt": "3", "echo": True}, "echo"),
    ({"prompt": "3", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true, as OpenAI
    ({"prompt": "3", "sampler": {"name": "eta"}}, "sampler"), ({"prompt": "3", "sampler": {"name": "top_p", "p": 2}}, "sampler"),
    ({"prompt": "3", "sampler": {"name": "typical", "p": 1.0}}, "sampler"),  # as a config's sampler is refused
    ({"prompt": "3", "sampler": {"name": "eta", "eta": 1.0}}, "sampler"),
    ({"prompt": "3", "max_new_tokens": 5}, "max_new_tokens"), ({"prompt": "3", "greedy": True}, "greedy"),
]


def test_bad_requests_on_both_routes_get_400_naming_the_field_and_the_app_keeps_answering(client):
    for route, cases in (("/generate", BAD_GENERATE), ("/v1/completions", BAD_COMPLETIONS)):
        for body, field in cases:
            assert_field_error(*call(client, route, body), field, context=(route, body))
        # FastAPI reads JSON only from a request that says it is JSON
        for content_type in (None, "application/x-www-form-urlencoded", "text/plain"):
            status, reply = call(client, route, {"prompt": "3"}, content_type=content_type)
            assert_field_error(status, reply, "request body", context=content_type)
            assert "Content-Type: application/json" in error_message(reply)
        assert_field_error(*call(client, route, {"prompt": "3 " * 600_000}), "request body", want_status=413)
        assert_field_error(client.put(route).status_code, client.put(route).json(), "method", want_status=405)
    assert "max_new_tokens" in error_message(call(client, "/v1/completions", {"prompt": "3", "max_new_tokens": 5})[1])
    assert "max_tokens" in error_message(call(client, "/v1/completions", {"prompt": "3", "max_new_tokens": 5})[1])
    response = client.get("/nowhere")
    assert_field_error(response.status_code, response.json(), "path", want_status=404)
    # a failure inside generation is a 500 in the same form, and the next request is answered
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(client.policy.batcher, "step", lambda: 1 / 0)
        assert_field_error(*call(client, "/v1/completions", {"prompt": "3"}), "internal error", want_status=500)
    # harmless OpenAI fields are taken; the app still answers both routes
    status, reply = call(client, "/v1/completions", {"prompt": "3 7", "max_tokens": 3, "stream": False, "user": "u"})
    assert status == 200 and len(reply["choices"]) == 1, reply
    status, reply = call(client, "/generate", {"prompt": "3 7", "max_new_tokens": 3.0, "seed": 0})
    assert status == 200 and reply["max_new_tokens"] == 3 and len(reply["generations"]) == 1, reply


def test_completions_answer_in_the_openai_format_with_usage_from_the_tokenizer(client):
    tok = client.policy.tokenizer
    body = {"model": "my-policy", "prompt": "3 7 12", "max_tokens": 8, "n": 8, "seed": 0}
    finish_reasons = set()
    for seed in range(5):  # until both finish reasons have occurred (the first seed already has both)
        status, reply = call(client, "/v1/completions", {**body, "seed": seed})
        assert status == 200, reply
        assert set(reply) == {"id", "object", "created", "model", "choices", "usage"}
        assert reply["object"] == "text_completion" and reply["model"] == "my-policy"
        assert reply["id"].startswith("cmpl-") and abs(reply["created"] - time.time()) < 600
        assert [c["index"] for c in reply["choices"]] == list(range(8))
        written = 0
        for c in reply["choices"]:
            assert set(c) == {"text", "index", "logprobs", "finish_reason"} and c["logprobs"] is None
            n_text = len(tokens_of(tok, c["text"])) if c["text"] else 0
            if c["finish_reason"] == "length":
                assert n_text == 8, c
            else:
                assert c["finish_reason"] == "stop" and n_text < 8, c
            written += n_text + (c["finish_reason"] == "stop")  # EOS is written but not shown
            finish_reasons.add(c["finish_reason"])
        usage = reply["usage"]
        assert usage["prompt_tokens"] == len(tokens_of(tok, "3 7 12")) == 3  # once, not once per choice
        assert usage["completion_tokens"] == written
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if finish_reasons == {"stop", "length"}:
            break
    assert finish_reasons == {"stop", "length"}

    # the same seed gives the same text; another seed other text
    again = call(client, "/v1/completions", {**body, "seed": seed})[1]
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in reply["choices"]]
    other = call(client, "/v1/completions", {**body, "seed": seed + 100})[1]
    assert [c["text"] for c in other["choices"]] != [c["text"] for c in reply["choices"]]

    # a list of prompts: choices prompt-major, each prompt counted once (cut to env.max_prompt_len = 5)
    status, reply = call(client, "/v1/completions", {"prompt": ["3", "1 2 3 4 5 6 7"], "n": 2, "max_tokens": 4,
                                                      "seed": 1})
    assert status == 200 and len(reply["choices"]) == 4, reply
    assert reply["usage"]["prompt_tokens"] == 1 + 5
    assert reply["model"] == os.path.basename(client.policy.info["checkpoint"])
    # the rows are the ones /generate samples: the same prompt, seed and length give the same texts
    single = call(client, "/v1/completions", {"prompt": "3", "n": 2, "max_tokens": 4, "seed": 1})[1]
    generated = call(client, "/generate", {"prompt": "3", "num_samples": 2, "max_new_tokens": 4, "seed": 1})[1]
    assert [c["text"] for c in single["choices"]] == [g["text"] for g in generated["generations"]]
    assert [c["text"] for c in reply["choices"][:2]] == [c["text"] for c in single["choices"]]

    # temperature 0 is /generate's greedy; a vanishing top_p keeps only the most likely token too
    greedy = call(client, "/generate", {"prompt": "3 7", "greedy": True})[1]["generations"][0]["text"]
    assert call(client, "/v1/completions", {"prompt": "3 7", "temperature": 0})[1]["choices"][0]["text"] == greedy
    for tiny in (1e-6, 1e-40, 5e-324):  # too small to divide float32 logits by (it was one token over and over)
        reply = call(client, "/v1/completions", {"prompt": "3 7", "temperature": tiny, "n": 2, "seed": 4})[1]
        assert [c["text"] for c in reply["choices"]] == [greedy, greedy], tiny
    narrow = call(client, "/v1/completions", {"prompt": "3 7", "top_p": 1e-9, "n": 2, "seed": 4})[1]
    assert [c["text"] for c in narrow["choices"]] == [greedy, greedy]
    hot = call(client, "/v1/completions", {"prompt": "3 7", "temperature": 2.0, "n": 4, "seed": 4})[1]
    plain = call(client, "/v1/completions", {"prompt": "3 7", "n": 4, "seed": 4})[1]
    assert [c["text"] for c in hot["choices"]] != [c["text"] for c in plain["choices"]]


def test_temperature_and_top_p_act_within_the_samplers_mask():
    from agents.samplers import warp_logits
    from agents.samplers import MASKED, top_k_mask

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    masked = logits.masked_fill(~top_k_mask(logits, 5), MASKED)
    assert torch.equal(warp_logits(masked), masked)  # the defaults leave the policy's distribution alone
    hot = warp_logits(masked, temperature=2.0)
    assert torch.equal(hot == MASKED, masked == MASKED) and torch.allclose(hot[masked > MASKED], masked[masked > MASKED] / 2)
    nucleus = warp_logits(masked, top_p=0.5)
    kept = nucleus > MASKED
    assert (kept <= (masked > MASKED)).all() and (kept.sum(-1) >= 1).all() and (kept.sum(-1) < 5).any()
    assert torch.equal(warp_logits(masked, top_p=1e-9).argmax(-1), masked.argmax(-1))
    assert (warp_logits(masked, top_p=1e-9) > MASKED).sum(-1).tolist() == [1, 1, 1, 1]


def test_openapi_docs_list_the_routes(client):
    response = client.get("/docs")
    assert response.status_code == 200 and "swagger" in response.text.lower()
    schema = client.get("/openapi.json").json()
    assert {"/generate", "/v1/completions", "/v1/models"} <= set(schema["paths"])
    assert set(schema["paths"]["/generate"]) == {"get", "post"} and "post" in schema["paths"]["/v1/completions"]
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "top_p", "n", "seed", "model"} <= set(fields)
    info = client.get("/generate").json()
    assert info["max_new_tokens"] == 20 and info["max_num_samples"] == MAX_SAMPLES and "/v1/completions" in info["routes"]
    assert client.get("/v1/models").json()["data"][0]["id"] == info["model"]


def test_replica_flags_give_serves_options_and_bad_combinations_are_refused_in_one_line(checkpoint, capsys,
                                                                                       monkeypatch):
    from agents.serve import main, make_app, replica_options

    assert replica_options() == {"num_replicas": 1}
    assert replica_options(num_replicas=2) == {"num_replicas": 2}
    auto = replica_options(max_replicas=4)
    assert auto == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                           "target_ongoing_requests": 2.0}}
    assert replica_options(2, 0, 3, 1.5)["autoscaling_config"] == {
        "min_replicas": 0, "max_replicas": 3, "initial_replicas": 2, "target_ongoing_requests": 1.5}
    assert replica_options(None, 0, 3)["autoscaling_config"]["initial_replicas"] == 1
    make_app(checkpoint, replicas=auto)  # Serve takes the options (it validates them when building the deployment)
    for argv, flag in [(["--num-replicas", "0"], "--num-replicas"), (["--min-replicas", "2"], "--min-replicas"),
                       (["--target-ongoing-requests", "3"], "--target-ongoing-requests"),
                       (["--min-replicas", "3", "--max-replicas", "2"], "--max-replicas"),
                       (["--max-replicas", "0"], "--max-replicas"), (["--min-replicas", "-1", "--max-replicas", "2"],
                                                                    "--min-replicas"),
                       (["--num-replicas", "3", "--max-replicas", "2"], "--num-replicas"),
                       (["--max-replicas", "2", "--target-ongoing-requests", "0"], "--target-ongoing-requests"),
                       (["--max-replicas", "2", "--target-ongoing-requests", "281"], "--target-ongoing-requests"),
                       (["--max-replicas", "2", "--batch-rows", "0", "--target-ongoing-requests", "9"],
                        "--target-ongoing-requests"),
                       (["--batch-rows", "-1"], "--batch-rows"), (["--max-queue", "-1"], "--max-queue"),
                       (["--batch-block", "0"], "--batch-block"), (["--precision", "fp16"], "--precision"),
                       (["--batch-rows", "4", "--max-queue", "2"], "--max-queue"),  # 16 samples never fit
                       (["--num-gpus", "-1"], "--num-gpus"), (["--num-gpus", "-0.5"], "--num-gpus"),
                       (["--num-gpus", "1.5"], "--num-gpus"),
                       (["--route-prefix", "api"], "--route-prefix"),
                       (["--direct-port", "8000"], "--direct-port"),  # --port's default
                       (["--direct-port", "65535", "--num-replicas", "2"], "--direct-port"),
                       (["--direct-port", "19990", "--max-replicas", "8"], "--direct-port")]:  # Ray's workers
        with pytest.raises(SystemExit) as e:
            main(["--checkpoint", checkpoint, *argv])
        assert e.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"python -m agents.serve: error: {flag}"), (argv, last)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # Serve's direct ports are set where Ray starts
    with pytest.raises(SystemExit):
        main(["--checkpoint", checkpoint, "--direct-port", "30000"])
    assert "--direct-port needs the private local Ray instance" in capsys.readouterr().err


# -- serving --------------------------------------------------------------------------------




def post(url: str, body, timeout: float = 60, with_headers: bool = False):
    """(status, JSON reply[, headers]) of a POST; `body` is JSON-encoded unless it is bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            out = response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as e:
        out = e.code, json.loads(e.read()), e.headers
    return out if with_headers else out[:2]


def start_server(checkpoint: str, log_dir, *args: str) -> ServeProcess:
    """`python -m agents.serve` serving `checkpoint` on a free loopback port, once it prints its URL
    (its stderr in `log_dir`)."""
    return ServeProcess(checkpoint, "--max-samples", "8", "--num-cpus", "0.25", *args, cwd=ROOT,
                        stderr_path=str(log_dir / "serve.stderr"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    srv = start_server(checkpoint, tmp_path_factory.mktemp("serve"))
    try:
        yield srv
    finally:
        srv.kill()  # whatever the tests did: the driver and every Ray process in its group


def tokens_of(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # the text is one the tokenizer writes
    assert all(t not in tokenizer.all_special_ids for t in ids)
    return ids


def assert_policy_wrote(model, tokenizer, prompt: str, text: str, max_new_tokens: int, greedy: bool):
    """The exported policy, restricted to its top-k tokens (argmax if greedy), can write `text` after `prompt`.

    An episode ends with EOS or after `max_new_tokens` tokens. The text does not show
    special tokens the policy may have written (pad), so those are tried where allowed.
    """
    hidden = [t for t in tokenizer.all_special_ids if t != tokenizer.eos_token_id]

    def explains(context, rest, steps_left):
        if steps_left == 0:
            return not rest
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([context])).logits[0, -1]
        bar = logits.max() if greedy else torch.topk(logits, TOP_K).values[-1]
        allowed = [t for t in ([rest[0]] if rest else []) + hidden if logits[t] >= bar - TOL]
        if not rest and logits[tokenizer.eos_token_id] >= bar - TOL:
            return True
        return any(explains(context + [t], rest[1:] if rest and t == rest[0] else rest, steps_left - 1)
                   for t in allowed)

    assert explains(tokens_of(tokenizer, prompt), tokens_of(tokenizer, text), max_new_tokens), (prompt, text)


@pytest.mark.slow
def test_served_generations_come_from_the_policy_with_its_sampler(server, exported):
    _, model, tokenizer = exported
    url = server.url
    assert url == f"http://127.0.0.1:{server.port}/generate"
    with urllib.request.urlopen(url, timeout=60) as response:  # GET: what the endpoint takes
        info = json.loads(response.read())
    assert info["max_new_tokens"] == 20 and info["sampler"]["name"] == "top_k"

    prompt = "3 7 12"
    status, reply = post(url, {"prompt": prompt, "num_samples": 4, "seed": 11})
    assert status == 200, reply
    texts = [g["text"] for g in reply["generations"]]
    assert len(texts) == 4 and reply["seed"] == 11 and reply["prompt"] == prompt
    assert all(text for text in texts)
    for g in reply["generations"]:
        assert 0.0 <= g["reward"] <= 1.0
        assert_policy_wrote(model, tokenizer, prompt, g["text"], 20, greedy=False)
    assert len(set(texts)) > 1  # sampled, not argmax
    assert post(url, {"prompt": prompt, "num_samples": 4, "seed": 11})[1]["generations"] == reply["generations"]

    status, first = post(url, {"prompt": prompt, "greedy": True})
    assert status == 200, first
    second = post(url, {"prompt": prompt, "greedy": True, "seed": 5})[1]
    assert first["generations"][0]["text"] == second["generations"][0]["text"] != ""
    assert_policy_wrote(model, tokenizer, prompt, first["generations"][0]["text"], 20, greedy=True)

    from env.text_env import TokenGenerationEnv

    status, short = post(url, {"prompt": "5", "max_new_tokens": 4, "num_samples": 3, "seed": 2})
    assert status == 200 and len(short["generations"]) == 3, short
    env = TokenGenerationEnv({**info["env"], "max_new_tokens": 4})  # the task's reward for 4-token episodes
    for g in short["generations"]:
        assert_policy_wrote(model, tokenizer, "5", g["text"], 4, greedy=False)
        assert g["reward"] == pytest.approx(env.score(["5"], [g["text"]], [{}])[0])

    status, long = post(url, {"prompt": "1 2 3 4 5 6 7", "greedy": True})  # cut to the last 5 tokens
    assert status == 200 and long["prompt_truncated"] is True and long["prompt"] == "3 4 5 6 7"


@pytest.mark.slow
def test_bad_requests_on_both_routes_get_400_naming_the_field_and_the_server_keeps_serving(server):
    url, completions = server.url, server.base + "/v1/completions"
    for route, cases in ((url, BAD_GENERATE), (completions, BAD_COMPLETIONS)):
        for body, field in cases:
            assert_field_error(*post(route, body, timeout=30), field, context=(route, body))
        assert_field_error(*post(route, {"prompt": "3 " * 600_000}, timeout=30), "request body", want_status=413)
    status, reply = post(url, {"prompt": "3 7", "max_new_tokens": 3, "seed": 0})
    assert status == 200 and len(reply["generations"]) == 1 and reply["generations"][0]["text"], reply
    status, reply = post(completions, {"prompt": "3 7", "max_tokens": 3, "seed": 0})
    assert status == 200 and len(reply["choices"]) == 1, reply
    assert server.proc.poll() is None


@pytest.mark.slow
def test_served_completions_over_plain_http_in_the_openai_format(server, policy):
    url = server.base + "/v1/completions"
    body = {"model": "m", "prompt": "3 7 12", "max_tokens": 6, "n": 3, "seed": 7}
    status, reply, headers = post(url, body, with_headers=True)
    assert status == 200, reply
    assert headers["X-Replica"] and reply["object"] == "text_completion" and reply["model"] == "m"
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] in ("stop", "length") and c["logprobs"] is None for c in reply["choices"])
    usage = reply["usage"]
    assert usage["prompt_tokens"] == len(tokens_of(policy.tokenizer, "3 7 12"))
    shown = sum(len(tokens_of(policy.tokenizer, c["text"])) if c["text"] else 0 for c in reply["choices"])
    assert shown <= usage["completion_tokens"] <= 3 * 6  # the text omits EOS (and <pad>, if written)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert post(url, body)[1]["choices"] == reply["choices"]  # the same seed, the same text
    with urllib.request.urlopen(server.base + "/docs", timeout=30) as response:
        assert response.status == 200 and "swagger" in response.read().decode().lower()
    with urllib.request.urlopen(server.base + "/openapi.json", timeout=30) as response:
        assert {"/generate", "/v1/completions"} <= set(json.loads(response.read())["paths"])


@pytest.mark.slow
def test_ctrl_c_shuts_the_server_down_cleanly(server):
    os.killpg(server.proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
    server.wait_for(r"^stopped", timeout=120)
    assert server.proc.wait(timeout=60) == 0
    shutdown = "".join(server.lines.seen).split("shutting down Serve", 1)[1]
    assert shutdown.strip() == "stopped", shutdown  # no library lines between the two
    with pytest.raises(OSError):  # nothing listens on the port any more
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_serve_cli_refuses_bad_input_before_it_imports_ray_or_torch(tmp_path):
    """A wrong flag or checkpoint is refused at once: the command line checks them before it
    imports Ray, Serve, torch, transformers or FastAPI (seconds on a laptop)."""
    from agents.saved_policy import MODULE_SUBDIR

    assert_refused_lightly("agents.serve", [
        (["--checkpoint", tmp_path], f"error: --checkpoint: {tmp_path} holds no policy (looked for {MODULE_SUBDIR})"),
        (["--checkpoint", tmp_path, "--precision", "fp16"], "python -m agents.serve: error: --precision")])


def test_serve_cli_refuses_a_taken_port_and_a_path_without_a_policy(checkpoint, tmp_path):
    # A checkpoint whose weights were cut short: the replicas cannot load it, and the error is
    # theirs in one line (not Serve's "Deploying application ... failed"). Its server starts a Ray
    # instance and a replica, so it runs while the refusals below are checked. Serve tries a
    # replica that fails to start 3 times before it fails the deployment (each try a new replica
    # process, seconds on 2 cores); one try ends in the same error, through the same code.
    cut = tmp_path / "cut"
    shutil.copytree(checkpoint, cut)
    (state,) = cut.rglob("module_state.pkl")
    state.write_bytes(state.read_bytes()[:100])
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    broken_stderr = open(tmp_path / "broken.stderr", "w+")
    broken = subprocess.Popen(
        [sys.executable, "-m", "agents.serve", "--checkpoint", str(cut), "--port", str(free_port()), "--num-cpus", "0.5"],
        cwd=ROOT, env={**env, "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1"}, stdout=subprocess.DEVNULL,
        stderr=broken_stderr, text=True, start_new_session=True)  # its own group, with its Ray processes
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            taken = run("agents.serve", "--checkpoint", checkpoint, "--port", str(port), timeout=120)
            direct = run("agents.serve", "--checkpoint", checkpoint, "--port", str(free_port()),
                         "--direct-port", str(port), timeout=120)
            # The port taken after the CLI's check (by another process starting at the same moment):
            # Serve's own bind fails, and the error is the same one line, not Ray's traceback.
            raced = subprocess.run(
                [sys.executable, "-c", "import sys, agents.serve.cli as c; c._check_port_free = lambda *a: None; "
                 "sys.exit(c.main(sys.argv[1:]))", "--checkpoint", checkpoint, "--port", str(port),
                 "--num-replicas", "1", "--num-cpus", "0.5"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        for refused in (taken, raced):
            assert refused.returncode == 2, refused.stderr[-2000:]
            error = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
            assert error == [f"error: --port: cannot listen on 127.0.0.1:{port} (Address already in use)"], \
                refused.stderr[-2000:]
        assert len(taken.stderr.strip().splitlines()) == 1
        assert direct.returncode == 2
        assert direct.stderr.strip() == f"error: --direct-port: cannot listen on 127.0.0.1:{port} (Address already in use)"
        # an address that is no host's, or not this machine's: --host is what is wrong, not --port
        from agents.serve.cli import _check_port_free

        for host, why in (("999.1.1.1", "--host: cannot listen on 999.1.1.1 ("), ("192.0.2.1", "--host: 192.0.2.1 is not an address")):
            with pytest.raises(ValueError) as bad:
                _check_port_free("--port", host, free_port())
            assert str(bad.value).startswith(why), str(bad.value)
        empty = tmp_path / "empty"
        empty.mkdir()
        missing = run("agents.serve", "--checkpoint", str(empty), "--port", str(free_port()), timeout=120)
        assert missing.returncode == 2
        assert missing.stderr.strip().startswith("error: --checkpoint:")
        broken.wait(timeout=300)
    finally:
        if broken.poll() is None:  # the test failed first: the server and its Ray processes go
            os.killpg(broken.pid, signal.SIGKILL)
            broken.wait()
        broken_stderr.seek(0)
        broken_err = broken_stderr.read()
        broken_stderr.close()
    assert broken.returncode == 2, broken_err[-2000:]
    assert broken_err.strip().startswith(f"error: --checkpoint: the policy in {cut}") and \
        broken_err.strip().endswith("cannot be loaded (UnpicklingError: pickle data was truncated)"), broken_err[-2000:]


@pytest.mark.slow
def test_two_replicas_both_answer(checkpoint, tmp_path):
    srv = start_server(checkpoint, tmp_path, "--num-replicas", "2")
    try:
        assert "2 replicas" in srv.wait_for(r"OpenAI completions: .*", timeout=30).group(0)
        url = f"http://127.0.0.1:{srv.port}/v1/completions"
        replicas, replies = set(), queue.Queue()

        def ask(seed):
            try:
                replies.put(post(url, {"prompt": "3 7", "max_tokens": 20, "n": 4, "seed": seed}, with_headers=True))
            except Exception as e:  # a lost request fails the test below, not silently in its thread
                replies.put(e)

        for round_ in range(5):  # concurrent requests until both replicas have answered
            threads = [threading.Thread(target=ask, args=(round_ * 16 + i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            answered = [replies.get() for _ in range(replies.qsize())]
            assert len(answered) == len(threads), f"{len(threads) - len(answered)} requests got no reply"
            for got in answered:
                assert not isinstance(got, Exception), got
                status, reply, headers = got
                assert status == 200 and len(reply["choices"]) == 4, reply
                replicas.add(headers["X-Replica"])
            if len(replicas) == 2:
                break
        assert len(replicas) == 2, replicas
    finally:
        srv.kill()


@pytest.mark.parametrize("declared", [True, False])
def test_a_refused_body_is_read_to_its_end_before_the_413(declared):
    # Answering while the client still sends leaves it a broken pipe, not the 413 (seen under load).
    import asyncio

    from agents.serve import BodyLimit

    def refused(size: int, chunk: int = 100, drain: int = 1000):
        chunks = [b"x" * chunk] * (size // chunk)
        events = []

        async def receive():
            i = sum(1 for e in events if e == "chunk")
            events.append("chunk")
            return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}

        async def send(message):
            events.append(message.get("status", message["type"]))

        async def app(scope, receive, send):
            raise AssertionError("the app must not see a refused body")

        headers = [(b"content-length", str(size).encode())] if declared else []
        asyncio.run(BodyLimit(app, max_bytes=250, drain_bytes=drain)({"type": "http", "headers": headers},
                                                                      receive, send))
        return events

    events = refused(800)
    assert events[:8] == ["chunk"] * 8 and events[8] == 413  # the whole body, then the answer
    if declared:  # a declared body beyond the drain limit is refused at once
        assert refused(5000)[0] == 413


def test_null_takes_a_fields_default_as_in_openais_api():
    """OpenAI clients send null for a field they leave at its default; a required field stays required."""
    from pydantic import ValidationError

    from agents.serve.requests import ChatRequest, CompletionRequest, GenerateRequest

    nulls = CompletionRequest.model_validate({"prompt": "3 7", "n": None, "temperature": None, "top_p": None,
                                             "stream": None, "max_tokens": None, "seed": None})
    assert nulls == CompletionRequest.model_validate({"prompt": "3 7"})
    assert GenerateRequest.model_validate({"prompt": "3", "num_samples": None, "greedy": None}) == \
        GenerateRequest.model_validate({"prompt": "3"})
    messages = [{"role": "user", "content": "3 7"}]
    assert ChatRequest.model_validate({"messages": messages, "n": None, "temperature": None}) == \
        ChatRequest.model_validate({"messages": messages})
    with pytest.raises(ValidationError, match="got null"):
        CompletionRequest.model_validate({"prompt": None})
