"""The policy server's requests and replies: pydantic models with their field validators
(no Ray, no model), `BadRequest`, and `error_line`, which turns validation errors into the one
line a refused request gets back.

/generate fields (only `prompt` is required; any other field is an error):
  prompt          string the task's tokenizer can encode, non-empty after tokenization
  max_new_tokens  integer in [1, env.max_new_tokens] (default: env.max_new_tokens).
                  Shorter generations ARE supported: the episode runs in the same
                  environment configured with this many new tokens, so the policy
                  stops after that many tokens (or at EOS) and `reward` is the
                  task's reward for an episode of that length.
  num_samples     integer in [1, --max-samples] (default 1): generations of the prompt
  greedy          boolean (default false): argmax decoding (after the sampler's mask)
  seed            integer in [0, 2**31 - 1] (default: random, and returned in the reply);
                  the same seed and request give the same generations
  references      string or list of strings: reference texts for tasks whose reward
                  compares the generation with references (BLEU, ROUGE, CIDEr, ...).
                  Without them such a task's `reward` is null (GET shows
                  `reward_needs_references`); the generations are the same.

POST /v1/completions takes the OpenAI completions request
    {"model": "policy", "prompt": "3 7 12", "max_tokens": 10, "temperature": 0.7, "top_p": 0.9, "n": 2, "seed": 0}
and answers in its format
    {"id": "cmpl-...", "object": "text_completion", "created": 1795000000, "model": "policy",
     "choices": [{"text": "13 15 ...", "index": 0, "logprobs": null, "finish_reason": "stop"}, ...],
     "usage": {"prompt_tokens": 3, "completion_tokens": 17, "total_tokens": 20}}
so OpenAI clients work against it (`OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")`).
  prompt       string or non-empty list of strings, each as for /generate (token ids are not taken);
               choices are ordered by prompt, then sample: index = prompt_index * n + j
  max_tokens   integer in [1, env.max_new_tokens] (default env.max_new_tokens, not OpenAI's 16: the
               policy was trained for that length)
  temperature  number in [0, 2] (default 1); top_p number in (0, 1] (default 1). They act ON TOP of
               the policy's trained sampler, not instead of it: the policy's logits, with the
               configured sampler's mask already applied, are divided by `temperature`, then cut to
               the nucleus of mass `top_p`. The defaults sample exactly as /generate does;
               temperature 0 (or any below 1e-5) is argmax (as /generate's greedy).
  n            integer in [1, --max-samples]; n times the number of prompts is at most --max-samples
  seed         integer in [0, 2**31 - 1] (default random): the same seed and request give the same text
  model        string, echoed in the reply (default: the checkpoint directory's name)
  sampler      one of the project's truncation samplers for this request, on top of the policy's
               own: {"name": "top_k", "k": 5}, {"name": "top_p" | "typical", "p": 0.9},
               {"name": "epsilon", "epsilon": 3e-4}, {"name": "eta", "eta": 3e-4} or
               {"name": "mirostat", "tau": 3.0, "learning_rate": 0.1} (its state kept per completion);
               its mask applies before temperature and top_p (temperature 0, argmax, ignores it)
  stop         a string or a list of at most 4 non-empty strings: a completion ends where one first
               appears (finish_reason "stop"); the text stops before it
  stream       true: the reply is server-sent events, OpenAI's `text_completion` chunks as the text
               grows (a stop string's possible beginning is held back), one chunk per choice with its
               finish_reason, then `data: [DONE]`; `stream_options: {"include_usage": true}` adds a
               last chunk with the usage. A client that goes away frees its rows at once.
  user         string, ignored
Any other field (logprobs, echo, ...) is refused naming it. `finish_reason` is "stop" when
the policy wrote EOS or a stop string, else "length". `usage.prompt_tokens` counts each prompt once, as the policy
saw it (after the left truncation to env.max_prompt_len); `completion_tokens` counts the tokens
the policy wrote over all choices, EOS included (the text omits EOS and other special tokens).

POST /v1/chat/completions takes OpenAI's chat request (`messages`: a non-empty list of
{"role": "system" | "user" | "assistant", "content": "..."}) where the policy's tokenizer has a
chat template: the messages become the prompt through it (with the generation prompt), and the
other fields are the completions route's (`max_completion_tokens` is another name for
`max_tokens`). It answers `chat.completion` objects (streamed: `chat.completion.chunk`s).

On the /v1/ routes an error is OpenAI's error object,
    {"error": {"message": "max_tokens: ...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
(the message is the line /generate sends as {"error": "max_tokens: ..."}).
"""
from __future__ import annotations

import json
import math
from typing import Annotated, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from agents.saved_policy import MAX_SEED

MAX_PROMPT_CHARS = 10_000
MAX_REFERENCES = 64
MAX_STOPS = 4
CHAT_ROLES = ("system", "user", "assistant")
# the application's routes (GET /generate lists them, and a 404 names them)
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/docs", "/openapi.json")


class BadRequest(ValueError):
    """A request the policy cannot take; its message is the one line sent back."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# -- request models (no Ray, no model) -----------------------------------------------------------
#
# Each field's validator writes its own one-line message; `error_line` puts the field's name in
# front. Types are checked here; limits that depend on the checkpoint or the CLI (max_new_tokens,
# num_samples, the vocabulary) are checked by `Policy`, with messages of the same form.


def _type_name(value) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _invalid(reason: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_field", "{reason}", {"reason": reason})


def _shown(value) -> str:
    return f"{_type_name(value)} {json.dumps(value)[:80]}"


def _json_int(value) -> int | None:
    """`value` as an integer if JSON writes it as one (3 or 3.0; not 3.5, true or "3"), else None."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _integer(lo: int | None = None, hi: int | None = None):
    what = (f"an integer in [{lo}, {hi}]" if hi is not None else
            f"an integer >= {lo}" if lo is not None else "an integer")

    def check(value):
        if value is None:  # where the field allows null (= its default)
            return None
        number = _json_int(value)
        if number is None:
            raise _invalid(f"must be {what}, got {_shown(value)}")
        if (lo is not None and number < lo) or (hi is not None and number > hi):
            raise _invalid(f"must be {what}, got {number}")
        return number

    return BeforeValidator(check)


def _number(lo: float, hi: float, *, lo_open: bool = False):
    what = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"

    def check(value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _invalid(f"must be {what}, got {_shown(value)}")
        if value < lo or (lo_open and value == lo) or value > hi:
            raise _invalid(f"must be {what}, got {value:g}")
        return float(value)

    return BeforeValidator(check)


def _boolean(value):
    if not isinstance(value, bool):
        raise _invalid(f"must be true or false, got {_shown(value)}")
    return value


def _text(value, what: str = "a string"):
    if not isinstance(value, str):
        raise _invalid(f"must be {what}, got {_type_name(value)}")
    if len(value) > MAX_PROMPT_CHARS:
        raise _invalid(f"longer than {MAX_PROMPT_CHARS} characters")
    return value


def _texts(value):
    """A completions prompt: a string or a non-empty list of strings."""
    what = "a string or a non-empty list of strings"
    if isinstance(value, list):
        if not value:
            raise _invalid(f"must be {what}, got an empty list")
        if not all(isinstance(v, str) for v in value):
            bad = next(v for v in value if not isinstance(v, str))
            ids = " (token ids are not taken: send text)" if _json_int(bad) is not None else ""
            raise _invalid(f"must be {what}, got a list holding {_type_name(bad)}{ids}")
        if sum(len(v) for v in value) > MAX_PROMPT_CHARS:
            raise _invalid(f"longer than {MAX_PROMPT_CHARS} characters in all")
        return value
    return _text(value, what)


def _references(value):
    if value is None:
        return None
    refs = [value] if isinstance(value, str) else value
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) and r.strip() for r in refs):
        raise _invalid(f"must be a non-empty string or a non-empty list of non-empty strings, "
                       f"got {json.dumps(value)[:80]}")
    if len(refs) > MAX_REFERENCES or sum(len(r) for r in refs) > MAX_PROMPT_CHARS:
        raise _invalid(f"at most {MAX_REFERENCES} texts of {MAX_PROMPT_CHARS} characters in all")
    return refs


def _stops(value):
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or not stops or len(stops) > MAX_STOPS
            or not all(isinstance(x, str) and x for x in stops)):
        raise _invalid(f"must be a non-empty string or a list of 1 to {MAX_STOPS} non-empty strings, "
                       f"got {_shown(value)}")
    if sum(len(x) for x in stops) > MAX_PROMPT_CHARS:
        raise _invalid(f"longer than {MAX_PROMPT_CHARS} characters in all")
    return stops


def _sampler(value):
    """A request's truncation sampler: {"name": one of the project's samplers, its parameters}."""
    from agents.samplers import sampler_value_error
    from agents.schema import GENERIC_SCHEMA, SAMPLER_PARAMS

    if value is None:
        return None
    if not isinstance(value, dict) or value.get("name") not in SAMPLER_PARAMS:
        raise _invalid(f'must be an object like {{"name": "top_k", "k": 5}} with name one of '
                       f'{", ".join(SAMPLER_PARAMS)}, got {_shown(value)}')
    name, fields = value["name"], GENERIC_SCHEMA["sampler"]
    params = SAMPLER_PARAMS[name]
    unknown = sorted(set(value) - {"name", *params})
    if unknown:
        raise _invalid(f"{unknown[0]} is not a parameter of {name} (it takes: {', '.join(params) or 'none'})")
    out = {"name": name}
    for p in params:
        if p not in value and fields[p].default is None:
            raise _invalid(f"{name} needs {p}")
        try:
            out[p] = fields[p].check(p, value.get(p, fields[p].default), error=ValueError)
        except ValueError as e:
            raise _invalid(str(e)) from None
        if error := sampler_value_error(name, p, out[p]):
            raise _invalid(error)
    return out


def _stream_options(value):
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"include_usage"}:
        raise _invalid(f'must be an object like {{"include_usage": true}}, got {_shown(value)}')
    return {"include_usage": _boolean(value.get("include_usage", False))}


def _messages(value):
    what = 'a non-empty list of {"role": "system" | "user" | "assistant", "content": "..."}'
    if not isinstance(value, list) or not value:
        raise _invalid(f"must be {what}, got {_shown(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"} or "role" not in m or "content" not in m:
            raise _invalid(f"[{i}] must be an object with role and content, got {_shown(m)}")
        if m["role"] not in CHAT_ROLES:
            raise _invalid(f"[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {_shown(m['role'])}")
        if not isinstance(m["content"], str):
            raise _invalid(f"[{i}].content must be a string (text parts are not taken), got {_type_name(m['content'])}")
    if sum(len(m["content"]) for m in value) > MAX_PROMPT_CHARS:
        raise _invalid(f"longer than {MAX_PROMPT_CHARS} characters in all")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _lone_surrogate(node, path: str = "") -> str | None:
    """The dotted path of the first string in `node` (keys included) holding a surrogate code point."""
    if isinstance(node, str):
        return (path or "request body") if any("\ud800" <= ch <= "\udfff" for ch in node) else None
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        inner = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and _lone_surrogate(key):
            return path or "request body"
        found = _lone_surrogate(value, inner)
        if found:
            return found
    return None


class _StrictFields(BaseModel):
    """Refuses a field it does not know, naming it (before any other check); takes null for a
    field's default."""

    model_config = ConfigDict(extra="forbid")
    other_route_names: ClassVar[dict[str, str]] = {}  # a field of the other route -> a hint

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        if isinstance(data, dict):
            where = _lone_surrogate(data)
            if where:  # JSON's \ud800 escapes decode to text no tokenizer (or reply) can encode
                raise PydanticCustomError("not_unicode", "{reason}", {
                    "field": where, "reason": "holds a lone UTF-16 surrogate (an escape such as \\ud83d without "
                                              "its pair, as a string cut inside an emoji has): not Unicode text"})
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                name = unknown[0]
                hint = cls.other_route_names.get(name)
                reason = f"unknown field (known: {', '.join(cls.model_fields)})"
                if hint:
                    reason += f"; {hint}"
                raise PydanticCustomError("unknown_field", "{reason}", {"field": name, "reason": reason})
            # null means the default, as in OpenAI's API: a field with one is left out
            data = {k: v for k, v in data.items()
                    if not (v is None and not cls.model_fields[k].is_required() and cls.model_fields[k].default is not None)}
        return data


Seed = Annotated[Optional[int], _integer(0, MAX_SEED),
                 Field(None, description="integer in [0, 2**31 - 1]; default: a random seed")]


class GenerateRequest(_StrictFields):
    """POST /generate: generations of one prompt, with the task's reward."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"prompt": "3 7 12", "max_new_tokens": 10, "num_samples": 2, "greedy": False, "seed": 0}]})
    other_route_names: ClassVar[dict[str, str]] = {
        "max_tokens": "/generate calls it max_new_tokens", "n": "/generate calls it num_samples",
        "temperature": "/generate has greedy; /v1/completions takes temperature",
        "top_p": "/v1/completions takes top_p"}

    prompt: Annotated[str, BeforeValidator(_text)] = Field(
        description="text the task's tokenizer can encode; cut to env.max_prompt_len tokens as in training (env.truncation_side)")
    max_new_tokens: Annotated[Optional[int], _integer()] = Field(
        None, description="integer in [1, env.max_new_tokens] (GET /generate shows it); default: that maximum")
    num_samples: Annotated[int, _integer()] = Field(1, description="generations, in [1, --max-samples]")
    greedy: Annotated[bool, BeforeValidator(_boolean)] = Field(
        False, description="argmax decoding (after the sampler's mask)")
    seed: Seed
    references: Annotated[Optional[list[str]], BeforeValidator(_references)] = Field(
        None, description="reference texts (string or list) for tasks whose reward compares with references")


class Generation(BaseModel):
    text: str
    reward: Optional[float] = Field(description="the task's reward; null where it needs references not given")


class GenerateResponse(BaseModel):
    prompt: str = Field(description="the prompt as the policy saw it (cut, without special tokens)")
    prompt_truncated: bool
    max_new_tokens: int
    greedy: bool
    seed: int
    generations: list[Generation]


class _SamplingFields(_StrictFields):
    """The fields the completions and chat routes share (OpenAI's sampling and reply options)."""

    model: Annotated[Optional[str], BeforeValidator(lambda v: v if v is None else _text(v))] = Field(
        None, description="echoed in the reply; default: the checkpoint's name")
    temperature: Annotated[float, _number(0, 2)] = Field(
        1.0, description="divides the policy's (sampler-masked) logits; 0 is argmax")
    top_p: Annotated[float, _number(0, 1, lo_open=True)] = Field(
        1.0, description="nucleus over the policy's (sampler-masked) distribution")
    n: Annotated[int, _integer()] = Field(1, description="completions per prompt, in [1, --max-samples]")
    seed: Seed
    stop: Annotated[Optional[list[str]], BeforeValidator(_stops)] = Field(
        None, description="a string or up to 4 strings: the text ends before the first that appears")
    sampler: Annotated[Optional[dict], BeforeValidator(_sampler)] = Field(
        None, description='one of the project\'s truncation samplers, e.g. {"name": "typical", "p": 0.9}, '
                          'on top of the policy\'s own')
    stream: Annotated[bool, BeforeValidator(_boolean)] = Field(False, description="server-sent events")
    stream_options: Annotated[Optional[dict], BeforeValidator(_stream_options)] = Field(
        None, description='{"include_usage": true}: a last chunk with the usage')
    user: Annotated[Optional[str], BeforeValidator(lambda v: v if v is None else _text(v))] = Field(
        None, description="ignored")

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:  # as OpenAI's API answers it
            raise PydanticCustomError("field_conflict", "{reason}", {
                "field": "stream_options", "reason": "only applies with stream: true"})
        return self


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: the OpenAI completions request (the fields this policy can honour)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "policy", "prompt": "3 7 12", "max_tokens": 10, "temperature": 0.7, "n": 2, "seed": 0}]})
    other_route_names: ClassVar[dict[str, str]] = {
        "max_new_tokens": "this route calls it max_tokens", "num_samples": "this route calls it n",
        "greedy": "temperature 0 is argmax here", "references": "/generate takes references and gives rewards"}

    prompt: Annotated[Union[str, list[str]], BeforeValidator(_texts)] = Field(
        description="a string or a list of strings, each cut to env.max_prompt_len tokens as in training")
    max_tokens: Annotated[Optional[int], _integer()] = Field(
        None, description="integer in [1, env.max_new_tokens]; default: that maximum")


class ChatRequest(_SamplingFields):
    """POST /v1/chat/completions: OpenAI's chat request, for a tokenizer with a chat template."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "policy", "messages": [{"role": "user", "content": "3 7 12"}], "max_tokens": 10, "seed": 0}]})
    other_route_names: ClassVar[dict[str, str]] = {"prompt": "this route takes messages; /v1/completions takes prompt",
                                                   **CompletionRequest.other_route_names}

    messages: Annotated[list[dict], BeforeValidator(_messages)] = Field(
        description='[{"role": "system" | "user" | "assistant", "content": "..."}], through the chat template')
    max_tokens: Annotated[Optional[int], _integer()] = Field(
        None, description="integer in [1, env.max_new_tokens]; default: that maximum")
    max_completion_tokens: Annotated[Optional[int], _integer()] = Field(None, description="max_tokens' other name")


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


def error_line(errors: list[dict]) -> str:
    """One `"<field>: <message>"` line for pydantic/FastAPI validation errors (the first that counts)."""
    def field_of(e):
        names = [str(x) for x in e.get("loc", ()) if x != "body" and not isinstance(x, int)]
        return names[0] if names else None

    for e in errors:  # an unknown field first, as the models check it first
        if e["type"] == "unknown_field":
            return f"{e['ctx']['field']}: {e['msg']}"
    e = errors[0]
    if e["type"] in ("field_conflict", "not_unicode"):  # a field other fields rule out; text that is not Unicode
        return f"{e['ctx']['field']}: {e['msg']}"
    field = field_of(e)
    if e["type"] == "json_invalid":
        return f"request body: not valid JSON ({(e.get('ctx') or {}).get('error', e['msg'])})"
    if field is None:  # the body as a whole
        if e["type"] == "missing":
            return "request body: required (a JSON object)"
        if isinstance(e.get("input"), (bytes, bytearray)):  # FastAPI reads JSON only when the request says so
            return "request body: send it as JSON with the header Content-Type: application/json"
        return (f"request body: must be a JSON object like {{\"prompt\": \"...\"}}, "
                f"got {_type_name(e.get('input'))}")
    if e["type"] == "missing":
        return f"{field}: required"
    if e["type"] == "invalid_field":
        return f"{field}: {e['msg']}"
    return f"{field}: {e['msg']}, got {_shown(e.get('input'))}"
