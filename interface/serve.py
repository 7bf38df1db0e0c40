"""``k3c serve``: a bundle behind OpenAI's HTTP API (FastAPI on uvicorn, prometheus_client).

``POST /v1/completions`` and ``/v1/chat/completions`` (messages rendered with the bundle's chat
template), streamed as server-sent events or not; ``GET /v1/models``; ``GET /health`` (503 until
the bundle is loaded); ``GET /metrics`` (Prometheus). Requests run on runtimes/engine.py's engine.
Every error is OpenAI's error object with its status: 400 for a bad request, 401 without the key
when one is set, 429 when the queue is full, 503 while loading, 500 when the device fails a step.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from ..errors import K3Error

MAX_LOGPROBS = 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields both endpoints share; unknown fields are ignored, as OpenAI's clients send some."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    logit_bias: dict[int, float] | None = None

    def bias(self) -> dict[int, float]:
        bias = self.logit_bias or {}
        if any(not -100 <= b <= 100 for b in bias.values()):
            raise ApiError(400, "logit_bias: each bias lies in [-100, 100]", param="logit_bias")
        return bias

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4:
            raise ApiError(400, "stop: at most 4 sequences", param="stop")
        return tuple(stops)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


@dataclass
class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self):
        r = self.registry
        self.requests = Counter("k3c_requests", "Requests answered, by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("k3c_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("k3c_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("k3c_time_to_first_token_seconds", "From a request's arrival to its first token",
                              registry=r, buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("k3c_inter_token_latency_seconds", "Between a sequence's consecutive tokens",
                             registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.occupancy = Gauge("k3c_active_sequences", "Sequences in flight (prompt or decode)", registry=r)
        self.batch = Histogram("k3c_decode_batch_size", "Sequences decoded together in one step", registry=r,
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.queue = Gauge("k3c_queue_length", "Requests waiting for a place", registry=r)


@dataclass
class Served:
    """What the server holds once the bundle is loaded."""
    engine: object = None
    tokenizer: object = None
    max_context: int = 0
    error: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)


def load(bundle, served: Served, max_active: int, max_queue: int, metrics: Metrics) -> None:
    """Open ``bundle`` (an artifacts.bundle.Bundle) on its device and start the engine (a thread of its own)."""
    from ..runtimes.engine import Engine
    from ..runtimes.session import Session
    from ..runtimes.tokenizer import bundle_tokenizer
    try:
        session = Session(bundle)
        served.tokenizer = bundle_tokenizer(bundle)
        served.max_context = session.max_context
        served.engine = Engine(session, served.tokenizer, max_active, max_queue, metrics.batch.observe)
    except K3Error as e:
        served.error = str(e)
    except Exception as e:   # anything else the runtime raises while loading: said by /health, not a traceback
        served.error = f"{type(e).__name__}: {e}"
    served.ready.set()


def create_app(bundle, *, model: str, api_key: str | None = None, max_active: int = 8,
               max_queue: int = 64) -> FastAPI:
    served, metrics = Served(), Metrics()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=load, args=(bundle, served, max_active, max_queue, metrics), daemon=True).start()
        yield
        if served.engine is not None:
            served.engine.stop()

    app = FastAPI(title="k3c", lifespan=lifespan, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return error_response(e.status, e.message, e.kind, e.param)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        return error_response(400, f"{'.'.join(loc)}: {first.get('msg')}" if loc else str(first.get("msg")),
                              param=loc[0] if loc else None)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.middleware("http")
    async def check_key_and_count(request: HttpRequest, call_next):
        if api_key is not None and request.url.path.startswith("/v1/") and \
                not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {api_key}"):
            response = error_response(401, "a valid API key is needed (Authorization: Bearer KEY)",
                                      "authentication_error")
        else:
            response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    def engine():
        if not served.ready.is_set():
            raise ApiError(503, "the model is loading", "server_error")
        if served.error:
            raise ApiError(503, f"the model failed to load: {served.error}", "server_error")
        return served.engine

    @app.get("/health")
    async def health():
        engine()
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        if served.engine is not None:
            metrics.occupancy.set(served.engine.occupancy)
            metrics.queue.set(served.engine.queue_length)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "k3c"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        eng = engine()
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request", param="prompt")
            prompt = prompt[0]
        ids = list(prompt) if isinstance(prompt, list) else served.tokenizer.encode(prompt)
        return await answer(eng, http, body, ids, body.max_tokens, body.logprobs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HttpRequest):
        from ..runtimes.chat import render_chat
        eng = engine()
        tok = served.tokenizer
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = render_chat(tok.chat_template, messages, tok.special_tokens,
                               max_chars=tok.text_limit(served.max_context))
        except K3Error as e:
            raise ApiError(400, str(e), param="messages") from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await answer(eng, http, body, tok.encode(text, chat=True),
                            body.max_completion_tokens or body.max_tokens, top, chat=True)

    async def answer(eng, http: HttpRequest, body: Sampling, ids: list[int], max_tokens: int | None,
                     top_logprobs: int | None, chat: bool):
        from ..runtimes.engine import QueueFull, Request
        from ..runtimes.sampling import Sampler
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            sampler = Sampler(body.temperature, body.top_k, body.top_p,
                              body.seed if body.seed is not None else secrets.randbits(63))
        except K3Error as e:
            raise ApiError(400, str(e).removeprefix("--")) from None
        request = Request(ids, max_tokens or served.max_context, sampler,
                          lambda event: loop.call_soon_threadsafe(events.put_nowait, event), body.stops(), top_logprobs,
                          body.bias())
        arrived = time.perf_counter()
        try:
            seq = eng.submit(request)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_exceeded") from None
        except K3Error as e:
            raise ApiError(400, str(e), param="prompt" if not chat else "messages") from None
        metrics.prompt_tokens.inc(len(ids))
        reply = Reply(served.tokenizer, model, chat, len(ids), top_logprobs is not None)

        async def steps():
            last = arrived
            try:
                while True:
                    event = await events.get()
                    if event.error:
                        raise ApiError(500, event.error, "server_error")
                    now = time.perf_counter()
                    (metrics.ttft if last == arrived else metrics.itl).observe(now - last)
                    last = now
                    metrics.generated_tokens.inc()
                    yield event
                    if event.finish_reason:
                        return
            finally:
                eng.cancel(seq)

        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(reply.sse(steps(), include_usage), media_type="text/event-stream")
        waiter = steps()
        try:
            while True:
                next_event = asyncio.ensure_future(waiter.__anext__())
                while not next_event.done():
                    await asyncio.wait([next_event], timeout=0.5)
                    if not next_event.done() and await http.is_disconnected():
                        next_event.cancel()
                        return error_response(499, "the client went away")
                try:
                    reply.add(next_event.result())
                except StopAsyncIteration:
                    return reply.whole()
        finally:
            await waiter.aclose()

    return app


class Reply:
    """One choice in OpenAI's shapes: built up event by event, whole or as stream chunks."""

    def __init__(self, tokenizer, model: str, chat: bool, prompt_tokens: int, logprobs: bool):
        self.tokenizer, self.model, self.chat, self.logprobs = tokenizer, model, chat, logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.prompt_tokens, self.tokens = prompt_tokens, 0
        self.text, self.finish_reason = "", None
        self.lp_entries: list = []

    def add(self, event) -> dict | None:
        """Take ``event``; its log-probabilities in this endpoint's form (None without them)."""
        self.tokens += 1
        self.text += event.text
        self.finish_reason = event.finish_reason
        if not self.logprobs:
            return None
        token = self.tokenizer.decode([event.token])
        tops = [(self.tokenizer.decode([i]), lp) for i, lp in event.top_logprobs]
        if self.chat:
            entry = {"token": token, "logprob": event.logprob, "bytes": list(token.encode()),
                     "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in tops]}
        else:
            entry = {"token": token, "logprob": event.logprob, "top": dict(tops)}
        self.lp_entries.append(entry)
        return entry

    def _logprobs(self, entries: list) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": entries}
        tokens = [e["token"] for e in entries]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries], "text_offset": offsets}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text}}
            kind = "chat.completion"
        else:
            choice, kind = {"index": 0, "text": self.text}, "text_completion"
        choice |= {"logprobs": self._logprobs(self.lp_entries), "finish_reason": self.finish_reason}
        return self._head(kind) | {"choices": [choice], "usage": self.usage()}

    def _chunk(self, text: str | None, entries: list, finish_reason: str | None, first: bool = False) -> str:
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
            choice, kind = {"index": 0, "delta": delta}, "chat.completion.chunk"
        else:
            choice, kind = {"index": 0, "text": text or ""}, "text_completion"
        choice |= {"logprobs": self._logprobs(entries) if entries else None, "finish_reason": finish_reason}
        return sse(self._head(kind) | {"choices": [choice]})

    async def sse(self, events, include_usage: bool):
        """``data: {chunk}`` per event, then the usage chunk when asked for, then ``data: [DONE]``.
        An error after the stream began ends it with an error object."""
        if self.chat:
            yield self._chunk(None, [], None, first=True)
        try:
            async for event in events:
                entry = self.add(event)
                yield self._chunk(event.text, [entry] if entry else [], event.finish_reason)
        except ApiError as e:
            yield sse({"error": {"message": e.message, "type": e.kind, "param": None, "code": None}})
            return
        if include_usage:
            yield sse(self._head("chat.completion.chunk" if self.chat else "text_completion")
                      | {"choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def serve(bundle_dir: str, host: str, port: int, api_key: str | None, model: str | None,
          max_active: int | None, max_queue: int, log=print) -> None:
    """Open the bundle (its checks, one error line when it fails) and serve it until interrupted."""
    import uvicorn

    from ..artifacts.bundle import open_bundle
    from ..runtimes.engine import active_limit
    bundle = open_bundle(bundle_dir)
    pool = bundle.pool
    max_active = active_limit(pool, max_active)
    if pool is None:
        log(f"note: {bundle.root} has no sequence pool: its sequences decode one at a time (k3c compile "
            "--max-batch N batches them)")
    name = model or bundle.root.resolve().name
    app = create_app(bundle, model=name, api_key=api_key, max_active=max_active, max_queue=max_queue)
    log(f"serving {bundle.root} as model {name!r} at http://{host}:{port}/v1")
    uvicorn.run(app, host=host, port=port, log_level="warning")
