"""The gateway: an OpenAI-compatible Starlette app in front of the Redis request queue.

    POST /v1/completions, /v1/chat/completions   generate (JSON, or SSE with stream=true)
    GET  /v1/streams/{request_id}                resume a resumable stream (Last-Event-ID)
    GET  /v1/models, /v1/models/{model}          the served model, under each served name
    POST /tokenize, /detokenize                  vLLM's shapes
    GET  /version                                {"version": ...}, as vLLM answers it
    GET  /health   200 when Redis answers and a scheduler beat is fresh, else 503
    GET  /ping     200 while the process is up (liveness)
    GET  /metrics  Prometheus: the gateway's counters, then every scheduler's
    GET  /openapi.json
    GET  /dashboard, /dashboard/stream   the live KV block map (dashboard.py)

Stateless: any replica can serve any request (or resume any stream). Bearer keys, when
configured, guard /v1/*, /tokenize and /detokenize (and /dashboard, which checks them
itself). Connection deadlines: limits.py; per-key budgets: budgets.py. A client's `X-Request-Id` (letters, digits, `_.-`, up to 100)
becomes the request's id (`cmpl-<it>`, `chatcmpl-<it>`) and is echoed in the response's
X-Request-Id header; without one the gateway makes a random id and sends that. Long
prompts are tokenized on one dedicated thread so the event loop keeps streaming meanwhile.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import importlib.metadata
import json
import logging
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from services.gateway.config import GatewayConfig
from services.gateway.dashboard import Dashboard
from services.gateway.detokenizer import TokenVocab
from services.gateway.follower import StreamFollower
from services.gateway.budgets import Holding, KeyBudgets, request_cost, tenant_id
from services.gateway.limits import uvicorn_options, within
from services.gateway.metrics import ENDPOINTS, GatewayMetrics, merge_expositions
from services.gateway.openapi import openapi_document
from services.gateway.protocol import RequestParser, model_not_found
from services.gateway.queue import QueueUnavailable, RequestQueue
from services.gateway.responses import dumps
from services.gateway.stream import RESUMABLE_HEADER, GenerationStream, Part
from services.gateway.validation import ApiError, bad
from shared.model_source import ModelNotFound, load_tokenizer, resolve_model
from shared.redis_keys import FINISHED_OUTPUT_TTL_S, OUTPUT_TTL_S

log = logging.getLogger("pagedserve.gateway")

try:
    _VERSION = importlib.metadata.version("pagedserve")
except importlib.metadata.PackageNotFoundError:     # run from a checkout, not installed
    _VERSION = "0+unknown"
INLINE_PARSE_BYTES = 8192   # bodies up to this size are parsed and tokenized on the event loop
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9_.-]{1,100}")   # room left for a prefix and -<i>
_ENTRY_ID = re.compile(r"\d{1,20}(-\d{1,20})?")
GUARDED = ("/v1", "/tokenize", "/detokenize")    # paths that need a key when keys are set


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(dumps(body), status, headers=headers, media_type="application/json")


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status, err.headers)


class Gateway:
    """Process-wide state shared by every request: config, tokenizer, Redis, metrics."""

    def __init__(self, config: GatewayConfig, tokenizer=None) -> None:
        self.config = config
        source = resolve_model(config.model)
        self.served_names = list(config.served_model_name) or [source.served_name]
        self.served_name = self.served_names[0]      # echoed in responses
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
        self.vocab = TokenVocab(self.tokenizer)
        self.parser = RequestParser(config, self.tokenizer, self.vocab, self.served_names)
        self.queue = RequestQueue(config.redis_url, config.redis_prefix,
                                  config.request_stream_maxlen,
                                  socket_timeout_s=config.read_block_ms / 1000 + 5.0,
                                  max_connections=config.redis_max_connections)
        self.follower = StreamFollower(self.queue, config.read_block_ms)
        self.metrics = GatewayMetrics()
        # Large bodies are tokenized here, off the event loop, one at a time.
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.created = int(time.time())
        self.retry_after = {"Retry-After": str(config.retry_after_s)}
        self._depth, self._depth_next_probe, self._gone = 0, 0.0, None
        self.budgets = KeyBudgets(self.queue, config.key_max_requests, config.key_max_tokens,
                                  self.retry_after)

    async def parse(self, fn: Callable, request: Request) -> Any:
        """fn(JSON body). Small bodies inline: a thread hop costs more than tokenizing a few
        KiB, and under load the GIL hand-over adds milliseconds per request."""
        body, size = await self.read_json(request)
        if size <= INLINE_PARSE_BYTES:
            return fn(body)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, fn, body)

    async def read_json(self, request: Request) -> tuple[Any, int]:
        """(parsed body, its size in bytes)."""
        limit = self.config.max_body_bytes
        too_big = ApiError(413, f"the request body is larger than {limit} bytes: send a shorter "
                                "prompt", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks = []

        async def receive_body() -> int:
            size = 0
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    chunks.append(chunk)
            except ClientDisconnect:
                raise bad("the client disconnected while sending the body") from None
            return size

        size = await within(self.config.body_timeout_s, receive_body(), "the request body")
        try:
            return json.loads(b"".join(chunks)), size
        except RecursionError:
            raise bad("the request body nests too deeply to be read") from None
        except ValueError as exc:
            raise bad(f"the request body is not valid JSON ({exc}): send a JSON object",
                      code="invalid_json") from None

    # ------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Holding:
        return await self._generate(request, self.parser.completion)

    async def chat_completions(self, request: Request) -> Holding:
        return await self._generate(request, self.parser.chat)

    async def _generate(self, request: Request, parse: Callable) -> Holding:
        client_id = request.headers.get("x-request-id")
        if client_id is not None and not _CLIENT_REQUEST_ID.fullmatch(client_id):
            raise bad("X-Request-Id must be 1 to 100 letters, digits, '_', '.' or '-'",
                      "X-Request-Id")
        resumable = request.headers.get(RESUMABLE_HEADER, "").lower() in ("true", "1")
        parsed = await self.parse(functools.partial(parse, request_id=client_id,
                                                    resumable=resumable), request)
        if client_id is not None and await self.queue.exists(parsed.requests[0].request_id):
            raise bad(f"X-Request-Id {client_id!r} was already used for a request whose "
                      "stream has not expired: send a new id", "X-Request-Id",
                      "duplicate_request_id")
        tenant = tenant_id(_client_key(request, bool(self.config.api_keys)))
        for r in parsed.requests:
            r.tenant = tenant
        holding = await self.budgets.take(tenant, request_cost(parsed.requests))
        try:
            stream = await self._enqueue(parsed, client_id)
        except BaseException:
            self.budgets.give(holding)
            raise
        return Holding(stream, self.budgets, holding)

    async def _enqueue(self, parsed, client_id: str | None) -> GenerationStream:
        await self.admit(len(parsed.requests))
        # Follow the output streams from their start; the reader's wake-up (if it is blocked)
        # rides in the same round trip as the enqueue.
        subs = [self.follower.register(r.request_id) for r in parsed.requests]
        try:
            header_ids = await self.queue.submit(parsed.requests, parsed.headers,
                                                 also=self.follower.wake_into)
        except BaseException:
            for sub in subs:
                self.follower.unsubscribe(sub)
            raise
        self.follower.ensure_reading()
        parts = [Part(h, hid, sub, self.vocab)
                 for h, hid, sub in zip(parsed.headers, header_ids, subs)]
        return GenerationStream(self, parsed.response_id, parts, echo_request_id=client_id)

    async def admit(self, count: int = 1) -> None:
        """429 when too many requests are unfinished. The depth is probed at most every
        queue_probe_s and counted up locally in between: one probe serves a burst. `count`:
        the prompts of the request, each one a request of the scheduler."""
        loop = asyncio.get_running_loop()
        if loop.time() >= self._depth_next_probe:
            self._depth_next_probe = loop.time() + self.config.queue_probe_s
            self._depth = await self.queue.depth()
            self._gone = await self.scheduler_gone()
        if self._gone is not None:
            self.metrics.rejected.labels("503").inc()
            raise ApiError(503, self._gone, code="no_scheduler", headers=self.retry_after)
        if self._depth >= self.config.max_queue:
            self.metrics.rejected.labels("429").inc()
            raise ApiError(429, f"the server is busy: {self._depth} requests are unfinished "
                                f"(limit {self.config.max_queue}); retry after "
                                f"{self.config.retry_after_s} s", code="queue_full",
                           headers=self.retry_after)
        self._depth += count

    async def resume(self, request: Request) -> GenerationStream:
        request_id = request.path_params["request_id"]
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
        if last is not None and not _ENTRY_ID.fullmatch(last):
            raise bad(f"Last-Event-ID {last[:64]!r} is not an event id of this server (they look "
                      "like 1700000000000-0)", "Last-Event-ID")
        found = await self.queue.header(request_id) if _REQUEST_ID.fullmatch(request_id) else None
        if found is None:
            raise ApiError(404, f"no output stream for request {request_id[:128]!r}: the id is "
                                f"unknown or its stream expired ({FINISHED_OUTPUT_TTL_S} s "
                                f"after the request finished, or {OUTPUT_TTL_S} s after its "
                                "last event)", param="request_id", code="stream_not_found")
        header_id, spec = found
        return GenerationStream(self, spec.request_id, [Part(spec, header_id, None, self.vocab)],
                                resumed=True, last_event_id=last)

    # ------------------------------------------------------------ models, tokenizer
    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created,
                "owned_by": "pagedserve", "root": self.served_name,
                "max_model_len": self.config.max_model_len}

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list",
                              "data": [self._card(n) for n in self.served_names]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.served_names:
            raise model_not_found(name, self.served_names)
        return json_response(self._card(name))

    async def version(self, request: Request) -> Response:
        return json_response({"version": _VERSION})

    async def tokenize(self, request: Request) -> Response:
        return json_response(await self.parse(self.parser.tokenize, request))

    async def detokenize(self, request: Request) -> Response:
        return json_response(await self.parse(self.parser.detokenize, request))

    # ------------------------------------------------------------ operations
    async def ping(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def scheduler_gone(self) -> str | None:
        """Why no scheduler will serve a request (schedulers are known but none has beaten
        for scheduler_gone_s), or None. With none known yet the stack is starting: None."""
        beats, _degraded, now = await self.queue.scheduler_status()
        gone_s = self.config.scheduler_gone_s
        if beats and all(now - t >= gone_s for t in beats.values()):
            return (f"no scheduler has been alive for {gone_s:g} s: the request was not "
                    f"served; retry in a few seconds")
        return None

    async def health(self, request: Request) -> Response:
        try:
            beats, degraded, now = await self.queue.scheduler_status()
        except QueueUnavailable as exc:
            return json_response({"status": "degraded", "reason": str(exc)}, 503)
        fresh_s = self.config.heartbeat_fresh_s
        alive = sorted(name for name, t in beats.items() if now - t < fresh_s)
        serving = [name for name in alive if name not in degraded]
        if serving:
            return json_response({"status": "ok", "schedulers": serving})
        if alive:
            reason = "; ".join(f"scheduler {n}: {degraded[n]}" for n in alive)
        else:
            reason = (f"no scheduler heartbeat in the last {fresh_s:g} s ({len(beats)} known): "
                      "start a scheduler or check its logs")
        return json_response({"status": "degraded", "reason": reason}, 503)

    async def metrics_text(self, request: Request) -> Response:
        text = self.metrics.exposition()
        try:
            text += merge_expositions(await self.queue.scheduler_metrics())
        except QueueUnavailable as exc:
            text += f"# scheduler metrics unavailable: {exc}\n"
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        return json_response(openapi_document(self.config, self.served_names, self.vocab.size))

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/streams/{request_id}", self.resume, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.ping, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            *Dashboard(self.queue, self.config.api_keys).routes(),
        ]


class GuardAndCount:
    """Outermost layer: Bearer keys on GUARDED paths (constant-time compare), requests counted
    by route."""

    def __init__(self, app, gateway: Gateway) -> None:
        self.app, self.gw = app, gateway
        self.keys = [k.encode() for k in gateway.config.api_keys]

    def _authorized(self, scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
        ok = False
        for key in self.keys:      # no early exit: timing says nothing about which key
            ok |= hmac.compare_digest(given, key)
        return ok

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def observe(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope["path"]
        try:
            if self.keys and path.startswith(GUARDED) and not self._authorized(scope):
                err = ApiError(401, "missing or wrong API key: send the header "
                                    "'Authorization: Bearer <key>'", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                await error_response(err)(scope, receive, observe)
            else:
                await self.app(scope, receive, observe)
        finally:
            self.gw.metrics.observe(_route_of(path), status)


def _client_key(request: Request, keyed: bool) -> str:
    """Whose budget a request counts against: its Bearer token when the gateway checks keys
    (`keyed`; the token was checked), else its address (a made-up token would dodge it)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if keyed and scheme.lower() == "bearer" and token.strip():
        return "key:" + token.strip()
    return "addr:" + (request.client.host if request.client else "?")


def _route_of(path: str) -> str:
    if path in ENDPOINTS:
        return path
    for prefix, name in (("/v1/models/", "/v1/models/{model}"),
                         ("/v1/streams/", "/v1/streams/{request_id}")):
        if path.startswith(prefix):
            return name
    return "other"


def _handlers(gw: Gateway) -> dict:
    async def api_error(request, exc: ApiError) -> Response:
        return error_response(exc)

    async def queue_down(request, exc: QueueUnavailable) -> Response:
        gw.metrics.rejected.labels("503").inc()
        return error_response(ApiError(503, f"{exc}: the request was not served; retry in a few "
                                            "seconds", code="redis_unavailable",
                                       headers=gw.retry_after))

    async def http_error(request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            msg = f"no endpoint at {request.url.path[:200]!r}: see /openapi.json"
        elif exc.status_code == 405:
            msg = (f"{request.method} is not allowed on {request.url.path[:200]!r}; use "
                   f"{(exc.headers or {}).get('Allow', 'another method')}")
        else:
            msg = str(exc.detail)
        return error_response(ApiError(exc.status_code, msg, headers=exc.headers))

    async def internal(request, exc: Exception) -> Response:
        # the server logs the traceback (ServerErrorMiddleware re-raises); never the client
        log.error("internal error on %s %s: %s", request.method, request.url.path,
                  type(exc).__name__)
        return error_response(ApiError(500, "internal error in the gateway; it was logged. "
                                            "Retry, and report it if it persists"))

    return {ApiError: api_error, QueueUnavailable: queue_down, HTTPException: http_error,
            Exception: internal}


def create_app(config: GatewayConfig | None = None, tokenizer=None) -> Starlette:
    """The gateway ASGI app. `tokenizer` may be passed in to share one already loaded."""
    gw = Gateway(config or GatewayConfig(), tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        log.info("gateway serving %s (max_model_len %d) on Redis %s", gw.served_name,
                 gw.config.max_model_len, gw.queue.where)
        yield
        await gw.follower.close()
        await gw.budgets.close()
        await gw.queue.close()
        gw.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    app = Starlette(routes=gw.routes(), middleware=[Middleware(GuardAndCount, gateway=gw)],
                    exception_handlers=_handlers(gw), lifespan=lifespan)
    app.state.gateway = gw
    return app


def main(argv: list[str] | None = None) -> int:
    """`python -m services.gateway.app [--flags]`: serve with uvicorn until interrupted."""
    import uvicorn

    config = GatewayConfig.from_argv(argv)
    try:
        config.check()
    except ValueError as exc:
        print(f"pagedserve gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        app = create_app(config)
    except ModelNotFound as exc:
        print(f"pagedserve gateway: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower(),
                access_log=False, **uvicorn_options(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
