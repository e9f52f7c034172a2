"""The HTTP application and its Serve deployment: one FastAPI `app` (`BodyLimit`, the error
handlers, the routes), `PolicyServer` (one replica, `@serve.ingress(app)`), `replica_options`
(fixed replicas or autoscaling) and `make_app` (the Serve application).

The routes are module functions on one FastAPI `app` that take the replica's
`Policy` as a FastAPI dependency (`replica_policy`), so the same application
runs in-process for tests with `app.dependency_overrides`.

A request the policy cannot take gets HTTP 400 (413 for a body over 1 MiB,
405 for a method a route does not take, 404 for an unknown path) and
`{"error": "<field>: <one line>"}`, FastAPI's validation errors included
(request bodies must be sent with `Content-Type: application/json`, as
FastAPI requires); the replica keeps serving. A failure inside generation is
a 500 with `{"error": "internal error: ..."}`, and the replica keeps serving
too. A reply with generations carries an `X-Replica` header naming the
replica that answered.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray import serve
from starlette.exceptions import HTTPException

from agents.serve.replica import Policy, replica_policy
from agents.serve.requests import (ROUTES, BadRequest, CompletionRequest, CompletionResponse, GenerateRequest,
                                   GenerateResponse, error_line)

MAX_BODY_BYTES = 1 << 20
MAX_ONGOING_REQUESTS = 8  # per replica: validation answers while a generation runs; generations queue

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


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return JSONResponse({"error": error_line(list(exc.errors()))}, status_code=400)


@app.exception_handler(BadRequest)
async def _bad_request(request: Request, exc: BadRequest):
    return JSONResponse({"error": str(exc)}, status_code=exc.status)


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
    return JSONResponse({"error": message}, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _answer(policy: Policy, check, run, req: BaseModel, response: Response) -> dict:
    """`run(check(req))`: the check (fast) on the event loop, the generation in a thread, so the
    replica keeps answering other requests meanwhile. A failure that is not a BadRequest is a 500."""
    try:
        checked = check(req)
        if policy.replica:
            response.headers["X-Replica"] = policy.replica
        return await asyncio.to_thread(run, checked)
    except BadRequest:
        raise
    except Exception as e:  # a bug or a task failure: report it, keep the replica up
        logger.exception("generation failed")
        message = " ".join(str(e).split()) or type(e).__name__
        raise BadRequest(f"internal error: {type(e).__name__}: {message}", status=500) from None


@app.post("/generate", response_model=GenerateResponse)
async def generate_route(req: GenerateRequest, response: Response, policy: Policy = Depends(replica_policy)):
    """Generations of a prompt by the policy, each with the task's reward."""
    return await _answer(policy, policy.check_generate, policy.generate, req, response)


@app.get("/generate")
async def describe_route(policy: Policy = Depends(replica_policy)) -> dict:
    """What /generate accepts: task, lengths, sampler, an example prompt, the fields."""
    return policy.info


@app.post("/v1/completions", response_model=CompletionResponse)
async def completions_route(req: CompletionRequest, response: Response, policy: Policy = Depends(replica_policy)):
    """The OpenAI completions API: choices and token usage (no reward)."""
    return await _answer(policy, policy.check_completion, policy.complete, req, response)


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

    def __init__(self, checkpoint: str, max_samples: int = 16):
        self.policy = Policy(checkpoint, max_samples)
        self.policy.replica = serve.get_replica_context().replica_tag


def replica_options(num_replicas: int | None = None, min_replicas: int | None = None,
                    max_replicas: int | None = None, target_ongoing_requests: float | None = None) -> dict:
    """Serve deployment options for a fixed number of replicas or for autoscaling (when
    `max_replicas` is given); raises ValueError naming the flag for a combination that cannot work."""
    if max_replicas is None:
        for flag, value in (("--min-replicas", min_replicas), ("--target-ongoing-requests", target_ongoing_requests)):
            if value is not None:
                raise ValueError(f"{flag} needs --max-replicas (autoscaling runs between --min-replicas and it)")
        n = 1 if num_replicas is None else num_replicas
        if n < 1:
            raise ValueError(f"--num-replicas must be >= 1 (got {n})")
        return {"num_replicas": n}
    lo = 1 if min_replicas is None else min_replicas
    if lo < 0:
        raise ValueError(f"--min-replicas must be >= 0 (got {lo})")
    if max_replicas < max(lo, 1):
        raise ValueError(f"--max-replicas must be >= 1 and >= --min-replicas {lo} (got {max_replicas})")
    start = max(lo, 1) if num_replicas is None else num_replicas
    if not lo <= start <= max_replicas:
        raise ValueError(f"--num-replicas (the replicas to start with when autoscaling) must lie in "
                         f"[--min-replicas, --max-replicas] = [{lo}, {max_replicas}] (got {start})")
    target = 2.0 if target_ongoing_requests is None else target_ongoing_requests
    if not 0 < target <= MAX_ONGOING_REQUESTS:
        raise ValueError(f"--target-ongoing-requests must be in (0, {MAX_ONGOING_REQUESTS}] (a replica takes "
                         f"{MAX_ONGOING_REQUESTS} requests at a time; got {target:g})")
    return {"autoscaling_config": {"min_replicas": lo, "max_replicas": max_replicas, "initial_replicas": start,
                                   "target_ongoing_requests": target}}


def make_app(checkpoint: str, *, num_replicas: int = 1, num_cpus: float = 0.5, max_samples: int = 16,
             replicas: dict | None = None):
    """The Serve application: PolicyServer replicas, each loading `checkpoint`: `num_replicas` of
    them, or as `replicas` (from `replica_options`, e.g. an autoscaling config) says."""
    deployment = serve.deployment(
        PolicyServer,
        name="PolicyServer",
        ray_actor_options={"num_cpus": num_cpus},
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        **(replicas or {"num_replicas": num_replicas}),
    )
    return deployment.bind(checkpoint, max_samples)
