"""The policy server as an OpenAI client sees it: the `openai` package (pinned in the test extra)
pointed at `python -m agents.serve`, for completions, streaming, chat and errors.

The checkpoint is a tiny GPT-2 policy for a text task whose tokenizer (a local directory, as a
hub tokenizer would be) has a chat template; the server runs as users run it, on a free loopback
port, stopped with SIGINT and its process group SIGKILLed afterwards.
"""
import threading

import pytest

from agents.serve.launch import free_port
from tests.conftest import write_jsonl
from tests.test_serve import start_server as start

openai = pytest.importorskip("openai")

WORDS = [str(i) for i in range(50)]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the contents, one after another


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import torch
    import yaml

    from agents.config import algorithm_config, load
    from agents.saved_policy import MODULE_SUBDIR
    from env.text_env import TokenGenerationEnv
    from env.tokenization import word_level_tokenizer

    root = tmp_path_factory.mktemp("openai")
    tok = word_level_tokenizer(WORDS)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(root / "tokenizer"))
    rows = [{"prompt": " ".join(WORDS[i:i + 3]), "ref": " ".join(WORDS[i + 3:i + 6])} for i in range(20)]
    data = {"train": write_jsonl(root / "train.jsonl", rows), "test": write_jsonl(root / "test.jsonl", rows[:5])}
    config = {"algorithm": "ppo", "seed": 0,
              "task": {"name": "text", "dataset": data, "reference_field": "ref"},
              "model": {"name_or_path": "tiny-gpt2"},
              "env": {"max_prompt_len": 8, "max_new_tokens": 12, "tokenizer": str(root / "tokenizer")}}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    algo_config = algorithm_config(load(str(root / "config.yaml")))
    module = algo_config.get_rl_module_spec(env=TokenGenerationEnv(algo_config.env_config)).build()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in module.lm.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    module.save_to_path(str(root / "ckpt" / MODULE_SUBDIR))
    return str(root / "ckpt")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """One replica, reached through Serve's proxy (--port) and on its own port (--direct-port)."""
    server = start(checkpoint, tmp_path_factory.mktemp("serve"), "--direct-port", str(free_port(2)))  # 2 a replica
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module", params=["proxy", "direct"])
def client(server, request):
    """The OpenAI client pointed at Serve's proxy, or at the replica's own port: the same routes."""
    if request.param == "direct":
        assert len(server.direct) == 1 and server.direct[0] != server.base, server.output()
    base = server.direct[0] if request.param == "direct" else server.base
    return openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)


@pytest.mark.slow
def test_the_replicas_own_port_answers_as_the_proxy_does(server):
    """The same request by both ways in: the same completion, from the same replica."""
    from tests.test_serve import post

    def answer(base):
        status, reply, headers = post(f"{base}/v1/completions", {"prompt": "3 4", "max_tokens": 8, "seed": 5, "n": 2},
                                      with_headers=True)
        assert status == 200, reply
        return headers["X-Replica"], [c["text"] for c in reply["choices"]]

    via_proxy, direct = answer(server.base), answer(server.direct[0])
    assert via_proxy == direct and via_proxy[0]


@pytest.mark.slow
def test_completions_and_their_stream_through_the_openai_client(client):
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt=["3 4 5", "10"], n=2, max_tokens=8, seed=7)
    assert reply.object == "text_completion" and len(reply.choices) == 4
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert reply.usage.prompt_tokens == 4 and reply.usage.total_tokens == 4 + reply.usage.completion_tokens
    again = client.completions.create(model=model, prompt=["3 4 5", "10"], n=2, max_tokens=8, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]

    texts, finish = ["", "", "", ""], [None] * 4
    usage = None
    for chunk in client.completions.create(model=model, prompt=["3 4 5", "10"], n=2, max_tokens=8, seed=7,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in reply.choices] and finish == [c.finish_reason for c in reply.choices]
    assert usage is not None and usage.completion_tokens == reply.usage.completion_tokens

    # a stop string: the text ends before it
    whole = client.completions.create(model=model, prompt="3 4 5", max_tokens=12, seed=3).choices[0].text
    words = whole.split()
    assert len(words) >= 3, whole
    stopped = client.completions.create(model=model, prompt="3 4 5", max_tokens=12, seed=3, stop=[f" {words[2]}"])
    assert stopped.choices[0].text == whole[:whole.find(f" {words[2]}")]
    assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_chat_through_the_openai_client(client):
    messages = [{"role": "system", "content": "3"}, {"role": "user", "content": "4 5"}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=8, seed=4, n=2)
    plain = client.completions.create(model="m", prompt="3 4 5", max_tokens=8, seed=4, n=2)
    assert chat.object == "chat.completion" and chat.model == "m"
    assert [c.message.role for c in chat.choices] == ["assistant", "assistant"]
    assert [c.message.content for c in chat.choices] == [c.text for c in plain.choices]
    content = ["", ""]
    for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=8, seed=4, n=2,
                                                stream=True):
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
    assert content == [c.message.content for c in chat.choices]


@pytest.mark.slow
def test_errors_arrive_as_openais_error_objects(client):
    cases = [(dict(prompt="3", max_tokens=0), "max_tokens"), (dict(prompt="three"), "prompt"),
             (dict(prompt="3", temperature=5), "temperature"), (dict(prompt="3", n=9), "n"),
             (dict(prompt="3", stop=["1", "2", "3", "4", "5"]), "stop"), (dict(prompt="3", logprobs=2), "logprobs")]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="m", **kwargs)
        assert e.value.status_code == 400 and e.value.param == field and e.value.type == "invalid_request_error"
        assert e.value.body["message"].startswith(f"{field}:") and "\n" not in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "3"}], max_tokens=99)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.with_options(base_url=str(client.base_url).replace("/v1", "/v2")).completions.create(
            model="m", prompt="3")
    assert client.completions.create(model="m", prompt="3", max_tokens=2).choices  # still serving


@pytest.mark.slow
def test_a_full_replica_refuses_with_429_and_loses_nothing_it_took(checkpoint, tmp_path):
    server = start(checkpoint, tmp_path, "--batch-rows", "1", "--max-queue", "0", "--max-samples", "1")
    try:
        client = openai.OpenAI(base_url=server.url.rsplit("/generate", 1)[0] + "/v1", api_key="-", max_retries=0,
                               timeout=60)
        outcomes = []

        def send(i):
            try:
                outcomes.append(len(client.completions.create(model="m", prompt="3", max_tokens=12, seed=i).choices))
            except openai.RateLimitError as e:
                outcomes.append(e.body["message"])

        threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        server.kill()
    assert len(outcomes) == 12
    refused = [o for o in outcomes if isinstance(o, str)]
    assert all(o == 1 for o in outcomes if not isinstance(o, str))  # every request taken was answered
    assert refused and all(o.startswith("server busy:") for o in refused), outcomes
