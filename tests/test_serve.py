"""Export of a policy to a plain transformers directory, and serving it over HTTP.

The checkpoint is the quickstart's policy (built as `agents.train` builds it, with a
top-3 truncation sampler so the configured sampler is visible in what the server
writes), its weights moved off their initial values, saved where a training
checkpoint keeps it. The server runs as users run it, `python -m agents.serve`, in
its own process group on a free loopback port, and is stopped with Ctrl-C (SIGINT)
like a user stops it; the group is SIGKILLed afterwards whatever happened.
"""
import json
import os
import queue
import re
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

from tests.conftest import QUICKSTART, ROOT
from tests.conftest import run_module as run

TOP_K = 3
TOL = 1e-4  # logits of the served (KV-cached) and exported (full) forward passes agree to float error


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from agents.config import algorithm_config, load
    from agents.generate import MODULE_SUBDIR
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


# -- request validation, without a server ---------------------------------------------------


def test_request_validation_names_the_field(policy):
    from agents.serve import BadRequest, parse_request

    def parse(body):
        return parse_request(body if isinstance(body, bytes) else json.dumps(body).encode(), policy.tokenizer,
                             max_new_tokens=20, max_prompt_len=5, max_samples=4)

    req = parse({"prompt": "3 7", "max_new_tokens": 5.0})
    assert req["max_new_tokens"] == 5 and req["num_samples"] == 1 and req["greedy"] is False
    assert 0 <= req["seed"] < 2**31 and req["prompt_truncated"] is False
    assert parse({"prompt": "1 2 3 4 5 6"})["prompt_truncated"] is True
    for body, field in [(b"{", "request body"), (b"\xff", "request body"), ([], "request body"),
                        ({}, "prompt"), ({"prompt": None}, "prompt"), ({"prompt": ["3"]}, "prompt"),
                        ({"prompt": "three"}, "prompt"), ({"prompt": " "}, "prompt"),
                        ({"prompt": "3", "max_new_tokens": 21}, "max_new_tokens"),
                        ({"prompt": "3", "max_new_tokens": True}, "max_new_tokens"),
                        ({"prompt": "3", "max_new_tokens": 2.5}, "max_new_tokens"),
                        ({"prompt": "3", "num_samples": 5}, "num_samples"),
                        ({"prompt": "3", "greedy": 1}, "greedy"), ({"prompt": "3", "seed": "7"}, "seed"),
                        ({"prompt": "3", "temperature": 0.5}, "temperature")]:
        with pytest.raises(BadRequest) as e:
            parse(body)
        assert str(e.value).startswith(f"{field}:"), (body, str(e.value))
        assert "\n" not in str(e.value)


# -- serving --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body, timeout: float = 60):
    """(status, JSON reply) of a POST; `body` is JSON-encoded unless it is bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Server:
    def __init__(self, checkpoint: str, log_dir):
        self.port = free_port()
        self.stderr_path = log_dir / "serve.stderr"
        self.stderr = open(self.stderr_path, "w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("RAY_ADDRESS", None)  # a private Ray instance, as on a user's machine
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agents.serve", "--checkpoint", checkpoint, "--host", "127.0.0.1",
             "--port", str(self.port), "--max-samples", "8", "--num-cpus", "0.25"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            start_new_session=True,  # its own process group, with the Ray processes it starts
        )
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.output = []

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float):
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.output.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no {pattern!r} in the server's output within {timeout}s:\n{''.join(self.output)}"
                             f"\nstderr:\n{self.stderr_path.read_text()[-3000:]}")

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.stderr.close()


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    srv = Server(checkpoint, tmp_path_factory.mktemp("serve"))
    try:
        m = srv.wait_for(r"at (http://\S+)", timeout=300)
        srv.url = m.group(1)
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
    assert status == 200, short
    env = TokenGenerationEnv({**info["env"], "max_new_tokens": 4})  # the task's reward for 4-token episodes
    for g in short["generations"]:
        assert_policy_wrote(model, tokenizer, "5", g["text"], 4, greedy=False)
        assert g["reward"] == pytest.approx(env.score(["5"], [g["text"]], [{}])[0])

    status, long = post(url, {"prompt": "1 2 3 4 5 6 7", "greedy": True})  # cut to the last 5 tokens
    assert status == 200 and long["prompt_truncated"] is True and long["prompt"] == "3 4 5 6 7"


@pytest.mark.slow
def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(server):
    url = server.url
    bad = [
        (b"{not json", "request body"),
        (b"[\"3 7\"]", "request body"),
        ({"max_new_tokens": 5}, "prompt"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": "three"}, "prompt"),  # not a word of the task's vocabulary
        ({"prompt": ""}, "prompt"),
        ({"prompt": "3", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "3", "max_new_tokens": 21}, "max_new_tokens"),
        ({"prompt": "3", "max_new_tokens": "5"}, "max_new_tokens"),
        ({"prompt": "3", "num_samples": 9}, "num_samples"),
        ({"prompt": "3", "greedy": "yes"}, "greedy"),
        ({"prompt": "3", "seed": -1}, "seed"),
        ({"prompt": "3", "max_tokens": 5}, "max_tokens"),
    ]
    for body, field in bad:
        status, reply = post(url, body, timeout=30)
        assert status == 400, (body, status, reply)
        assert set(reply) == {"error"} and reply["error"].startswith(f"{field}:"), (body, reply)
        assert "\n" not in reply["error"] and "Traceback" not in reply["error"]
    status, reply = post(url, {"prompt": "3 " * 600_000}, timeout=30)
    assert status == 413 and reply["error"].startswith("request body:"), (status, reply)
    status, reply = post(url, {"prompt": "3 7", "max_new_tokens": 3, "seed": 0})
    assert status == 200 and len(reply["generations"]) == 1 and reply["generations"][0]["text"], reply
    assert server.proc.poll() is None


@pytest.mark.slow
def test_ctrl_c_shuts_the_server_down_cleanly(server):
    os.killpg(server.proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
    server.wait_for(r"^stopped", timeout=120)
    assert server.proc.wait(timeout=60) == 0
    with pytest.raises(OSError):  # nothing listens on the port any more
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_serve_cli_refuses_a_taken_port_and_a_path_without_a_policy(checkpoint, tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        taken = run("agents.serve", "--checkpoint", checkpoint, "--port", str(port), timeout=120)
    assert taken.returncode == 2
    assert taken.stderr.strip().startswith("error: --port:") and len(taken.stderr.strip().splitlines()) == 1
    missing = run("agents.serve", "--checkpoint", str(tmp_path), "--port", str(free_port()), timeout=120)
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith("error: --checkpoint:")
