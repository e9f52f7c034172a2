"""The HTTP application and its Serve deployment: one FastAPI `app` (`BodyLimit`, the error
handlers, the routes), `PolicyServer` (one replica, `@serve.ingress(app)`) and `make_app` (the
Serve application; `replica_options`, fixed replicas or autoscaling, is agents/serve/options.py's).

The routes are module functions on one FastAPI `app` that take the replica's
`Policy` as a FastAPI dependency (`replica_policy`), so the same application
runs in-process for tests with `app.dependency_overrides`.

A request the policy cannot take gets HTTP 400 (413 for a body over 1 MiB,
405 for a method a route does not take, 404 for an unknown path, 429 when the
replica's queue is full) and `{"error": "<field>: <one line>"}`, FastAPI's
validation errors included (request bodies must be sent with `Content-Type:
application/json`, as FastAPI requires); on the /v1/ routes the same line is
the message of OpenAI's error object. The replica keeps serving. A failure
inside generation is a 500 with `internal error: ...`, and the replica keeps
serving too. A reply with generations carries an `X-Replica` header naming
the replica that answered.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from ray import serve
from starlette.exceptions import HTTPException

from agents.serve.batching import Busy
from agents.serve.options import BATCH_BLOCK, BATCH_ROWS, MAX_QUEUE, max_ongoing_requests
from agents.serve.replica import Policy, replica_policy
from agents.serve.replies import Chunks, openai_error, reply, sse
from agents.serve.requests import (ROUTES, BadRequest, ChatCompletionResponse, ChatRequest, CompletionRequest,
                                   CompletionResponse, GenerateRequest, GenerateResponse, error_line)

MAX_BODY_BYTES = 1 << 20

logger = logging.getLogger(__name__)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets a 413 before the app reads it
    (declared by Content-Length, or counted as it arrives). The refused body is read to its end
    first (up to `drain_bytes` in all): a server that answers and closes while the client is
    still sending leaves the client a broken pipe or a reset instead of the 413."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, drain_bytes: int = 16 * MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes

    async def _refuse(self, scope, receive, send, received: int, more: bool):
        while more and received <= self.drain_bytes:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            received += len(message.get("body", b""))
            more = message.get("more_body", False)
        response = JSONResponse({"error": f"request body: larger than {self.max_bytes} bytes"}, status_code=413)
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_bytes:
            return await self._refuse(scope, receive, send, 0, declared <= self.drain_bytes)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, size, more)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


app = FastAPI(
    title="Policy server",
    summary="A policy trained with this project's token-level RL, served with Ray Serve.",
    description="`POST /generate` is the project's own request (generations with the task's reward); "
                "`POST /v1/completions` is the OpenAI completions API. Errors are "
                "`{\"error\": \"<field>: <message>\"}` (400; 413 for a body over 1 MiB).",
    version="1",
)
app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)


def error_response(request: Request, message: str, status: int, headers=None) -> JSONResponse:
    """The one-line error: `{"error": line}`, or OpenAI's error object on the /v1/ routes."""
    body = openai_error(message, status) if "/v1/" in request.url.path else {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return error_response(request, error_line(list(exc.errors())), 400)


@app.exception_handler(BadRequest)
async def _bad_request(request: Request, exc: BadRequest):
    return error_response(request, str(exc), exc.status)


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException):
    path = request.url.path
    if exc.status_code == 404:
        message = f"path: {path} not found (routes: {', '.join(ROUTES)})"
    elif exc.status_code == 405:
        message = f"method: {request.method} is not supported on {path}"
    elif exc.status_code == 400:  # FastAPI could not read the body (not UTF-8, ...)
        message = f"request body: not valid JSON ({exc.detail})"
    else:
        message = f"request: {exc.detail}"
    return error_response(request, message, exc.status_code, getattr(exc, "headers", None))


def _internal(e: Exception) -> BadRequest:
    logger.exception("generation failed")
    message = " ".join(str(e).split()) or type(e).__name__
    return BadRequest(f"internal error: {type(e).__name__}: {message}", status=500)


async def _results(policy: Policy, checked: dict, job) -> list[dict]:
    """The request's completion results: from its batch job, or generated one request at a time
    in a thread (the replica keeps answering other requests meanwhile)."""
    if job is None:
        return await asyncio.to_thread(policy.run, checked)
    try:
        async for kind, _, value in job.events():
            if kind == "error":
                raise RuntimeError(value)
        return job.results
    except asyncio.CancelledError:  # the client went away: free its rows
        job.cancel()
        raise


async def _stream(kind: str, checked: dict, job):
    """The streamed reply's server-sent events (batched requests only: the one-at-a-time path
    refuses `stream`); `JobStream` cancels the job when the reply ends."""
    chunks = Chunks(kind, checked)
    for event in chunks.opening():
        yield event
    async for batch in job.event_batches():  # the events waiting together, in one write
        out = []
        for event, index, value in batch:
            if event == "delta":
                out.append(chunks.delta(index, value))
            elif event == "finish":
                out.append(chunks.finish(index, value["finish_reason"]))
            elif event == "error":
                out.append(sse(openai_error(value, 500)))
        if out:
            yield "".join(out)
        if batch[-1][0] == "error":
            return
    for event in chunks.closing(job.results):
        yield event


class JobStream(StreamingResponse):
    """A streamed reply that cancels its job when it ends, however it ends (a client that goes
    away frees its rows at the next block): the response's own task, not the events' generator,
    whose cleanup would wait for its finalization where the client left while a write waited."""

    def __init__(self, job, content, **kwargs):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()  # a no-op once every completion finished


async def _answer(kind: str, policy: Policy, check, req: BaseModel):
    """Checks the request (fast, on the event loop), then generates for it: queued for the
    batch's rows (429 when the queue is full) or one request at a time. A failure that is not a
    BadRequest is a 500."""
    checked = check(req)
    headers = {"X-Replica": policy.replica} if policy.replica else {}
    try:
        job = None if policy.batcher is None else policy.submit(checked, asyncio.get_running_loop())
    except Busy as e:
        raise BadRequest(str(e), status=429) from None
    if checked["stream"]:
        return JobStream(job, _stream(kind, checked, job), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **headers})
    try:  # the reply as built (the route's response_model documents it; validating it again costs time)
        return JSONResponse(reply(kind, checked, await _results(policy, checked, job)), headers=headers)
    except BadRequest:
        raise
    except Exception as e:  # a bug or a task failure: report it, keep the replica up
        raise _internal(e) from None


@app.post("/generate", response_model=GenerateResponse)
async def generate_route(req: GenerateRequest, policy: Policy = Depends(replica_policy)):
    """Generations of a prompt by the policy, each with the task's reward."""
    return await _answer("generate", policy, policy.check_generate, req)


@app.get("/generate")
async def describe_route(policy: Policy = Depends(replica_policy)) -> dict:
    """What /generate accepts: task, lengths, sampler, an example prompt, the fields; the batch's load."""
    return policy.describe()


@app.post("/v1/completions", response_model=CompletionResponse)
async def completions_route(req: CompletionRequest, policy: Policy = Depends(replica_policy)):
    """The OpenAI completions API: choices and token usage (no reward); `stream: true` for events."""
    return await _answer("completion", policy, policy.check_completion, req)


@app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_route(req: ChatRequest, policy: Policy = Depends(replica_policy)):
    """The OpenAI chat API, where the policy's tokenizer has a chat template."""
    return await _answer("chat", policy, policy.check_chat, req)


@app.get("/v1/models")
async def models_route(policy: Policy = Depends(replica_policy)) -> dict:
    """The served model, in the OpenAI format."""
    return {"object": "list", "data": [{"id": policy.model_name, "object": "model", "created": 0,
                                        "owned_by": "agents.serve"}]}


# -- the Serve deployment ----------------------------------------------------------------------
#
# After the routes: `serve.ingress` freezes a copy of `app` (routes, handlers, middleware) when it
# decorates the class.


@serve.ingress(app)
class PolicyServer:
    """One Serve replica: loads the checkpoint's `Policy` once; `app`'s routes answer with it."""

    def __init__(self, checkpoint: str, max_samples: int = 16, batch_rows: int = BATCH_ROWS,
                 max_queue: int = MAX_QUEUE, num_gpus: float = 0, batch_block: int = BATCH_BLOCK,
                 precision: str = "fp32"):
        import torch

        if num_gpus and not torch.cuda.is_available():
            raise RuntimeError("--num-gpus: the replica was given a GPU but torch sees no CUDA device")
        from agents.generate import check_precision

        device = "cuda" if num_gpus else "cpu"
        error = check_precision(precision, device)
        if error:
            raise RuntimeError(error)
        self.policy = Policy(checkpoint, max_samples, batch_rows, max_queue, device=device, batch_block=batch_block,
                             precision=precision)
        self.policy.replica = serve.get_replica_context().replica_tag


def make_app(checkpoint: str, *, num_replicas: int = 1, num_cpus: float = 0.5, max_samples: int = 16,
             replicas: dict | None = None, batch_rows: int = BATCH_ROWS, max_queue: int = MAX_QUEUE,
             num_gpus: float = 0, batch_block: int = BATCH_BLOCK, precision: str = "fp32"):
    """The Serve application: PolicyServer replicas, each loading `checkpoint`: `num_replicas` of
    them, or as `replicas` (from `replica_options`, e.g. an autoscaling config) says. Each replica
    batches `batch_rows` rows (0: one request at a time; `batch_block` steps a block) with up to
    `max_queue` completions waiting, on the CPU, or on a GPU of its own where `num_gpus` (a fraction
    is fine) is given, its weights in `precision` (fp32 or bf16)."""
    deployment = serve.deployment(
        PolicyServer,
        name="PolicyServer",
        ray_actor_options={"num_cpus": num_cpus, **({"num_gpus": num_gpus} if num_gpus else {})},
        max_ongoing_requests=max_ongoing_requests(batch_rows, max_queue),
        **(replicas or {"num_replicas": num_replicas}),
    )
    return deployment.bind(checkpoint, max_samples, batch_rows, max_queue, num_gpus, batch_block, precision)
