"""The streaming proxy: one raw ASGI endpoint per OpenAI route, forwarding to a worker pod over httpx.

Why raw ASGI rather than a FastAPI route: the proxy must own the whole life of a request (including the time
before the response starts) to propagate a client disconnect at any moment, and it sits on the hot path of
thousands of concurrent streams, where every per-chunk layer costs.

Life of a request: authenticate -> parse -> tier -> resolve model (a deployment, and the variant or LoRA adapter
it names: `gateway.routing.resolve_model`) -> per-key limits (a slot, one request and a token reservation of the
prompt estimate plus max_tokens: `gateway.ratelimit`; an adapter's shared `tokensPerMinute` bucket too) ->
admission (priority queue) -> choose variant (hold while it has no ready pod) -> attempts: choose pod (an adapter
request only among pods with the adapter Loaded: `gateway.routing.adapter_endpoints`; none: 503
`adapter_not_ready`), send (streams ask for usage: `gateway.usage`), and before the first response body byte
retry another pod only where a retry cannot repeat harm (`retry_elsewhere`: connection refused, a worker draining
or loading, a full queue, a pod that no longer has the adapter; never a dead engine, never another 4xx, a reset
once at most) -> commit: stream chunks through as they arrive (each `send` waits for the client socket to drain:
backpressure), picking the worker's usage out of the last events -> release, and settle the reservation from
the usage (no usage: the reservation stands).

The body goes upstream as the client sent it (plus `stream_options.include_usage` on streams), with one change:
`MODEL:VARIANT` becomes `MODEL`, since a worker serves its model under the base name and knows nothing of
variants. `MODEL:ADAPTER` and `ADAPTER` go as they are: the worker resolves both to the adapter (vLLM's naming).

A watcher task waits for `http.disconnect`; when the client leaves before the response completes it cancels the
request's task, and the `finally` blocks close the upstream response, which closes its connection, which the
worker sees as a disconnect and aborts the request. After the first byte nothing is retried: a failing upstream
ends the stream with an SSE error event (OpenAI SDKs raise on it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from gateway.admission import Rejected
from gateway.auth import Principal
from gateway.errors import error_body, sse_error_event
from gateway.middleware import internal_error_message
from gateway.ratelimit import ADAPTER_TOKENS, CONCURRENCY, CostError, Reservation, TokenBucket, request_cost
from gateway.routing import (
    AdapterRoute,
    DeploymentRoute,
    Endpoint,
    RoutingError,
    VariantRoute,
    adapter_endpoints,
    adapter_not_ready,
    affinity_key,
    choose_endpoint,
    choose_revision,
    choose_variant,
    prompt_text,
    resolve_model,
    serving_variants,
)
from gateway.settings import TierSettings
from gateway.state import GatewayState
from gateway.tiers import TierError, resolve_tier
from gateway.transport import PooledTransport, UpstreamResponse, header, read_all
from gateway.usage import (
    has_usage,
    strip_null_usage,
    take_usage,
    upstream_body,
    usage_of_body,
)

log = logging.getLogger("llmfleet.gateway")

_FORWARD_REQUEST_HEADERS = (b"content-type", b"accept", b"traceparent", b"tracestate")
# Never delivered: always safe to try elsewhere.
_UNDELIVERED_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# Maybe delivered (the worker may have read the request, then died of it): tried elsewhere once at most.
_MAYBE_DELIVERED_ERRORS = (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)
_RETRYABLE_ERRORS = _UNDELIVERED_ERRORS + _MAYBE_DELIVERED_ERRORS
_MAX_BODY_BYTES = 16 * 1024 * 1024
_MAX_PENDING_BYTES = 1024 * 1024  # a partial SSE line held back for the next read, at most
_USAGE_KEY = b'"usage"'  # the one substring scan each streamed chunk gets (see gateway.usage)

# The worker's error codes (worker_image/worker/server) that say "this pod cannot take it now, another can".
# `engine_dead` is absent on purpose: the request may be what killed the engine, and a retry would kill the next.
_RETRY_503_UNLESS = frozenset({"engine_dead"})
_RETRY_429_CODES = frozenset({"queue_full", "tokenizer_busy"})
# Retry-After of an adapter that failed on every pod: the operator's first retry comes after 10 s
# (controllers/adapters.py RETRY_FIRST_S), so asking sooner only repeats the 503.
_ADAPTER_FAILED_RETRY_AFTER_S = 10


def retry_elsewhere(status: int, code: str | None) -> bool:
    """Whether an upstream answer (before any body byte reached the client) is retried on another pod: a 503
    unless the engine died, a 429 only for the worker's full queues; never any other status."""
    if status == 503:
        return code not in _RETRY_503_UNLESS
    if status == 429:
        return code in _RETRY_429_CODES
    return False


class _Disconnected(Exception):
    """The client went away before sending its whole request."""


class _Failure(Exception):
    """The request ends with an error response from the gateway."""

    def __init__(self, status: int, message: str, code: str | None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


async def send_bytes(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """Send a whole response."""
    hdrs = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Send, status: int, message: str, code: str | None, headers: dict[str, str] | None = None
) -> None:
    hdrs = [(b"content-type", b"application/json")]
    hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send_bytes(send, status, error_body(status, message, code), hdrs)


class _DisconnectWatch:
    """Cancels the request's task when the client disconnects before the response is complete."""

    def __init__(self, receive: Receive) -> None:
        self.task = asyncio.current_task()
        self.disconnected = False
        self.finished = False
        self._loop = self.task.get_loop() if self.task is not None else asyncio.get_running_loop()
        self._listener = self._loop.create_task(self._listen(receive))

    async def _listen(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.finished and self.task is not None:
                    self.disconnected = True
                    self.task.cancel()
                return

    def stop(self) -> None:
        """The response is over: the listener ends by itself (a server wakes a pending `receive` with
        `http.disconnect` once the response is complete, as uvicorn does); one still waiting after the callbacks
        already due have run (the response did not complete) is cancelled. Not cancelling it in the common case
        matters: a cancelled task keeps its CancelledError, whose traceback holds the task's frame, a reference
        cycle per request that only the garbage collector frees."""
        self.finished = True
        if not self._listener.done():
            self._loop.call_soon(self._cancel_pending)

    def _cancel_pending(self) -> None:
        if not self._listener.done():
            self._listener.cancel()


@dataclass(frozen=True, slots=True)
class _Routed:
    """What a request's body and key decided before admission: its deployment (and variant suffix; its LoRA
    adapter is `_Request.adapter`), its tier, whether it streams, and its prompt text (for prefix affinity)."""

    dep: DeploymentRoute
    suffix: str | None
    tier: TierSettings
    stream: bool
    prompt: str


@dataclass
class _Upstream:
    """A committed upstream response: the pod it came from and, for streams, its first chunk."""

    response: UpstreamResponse
    url: str
    variant: str
    revision: str
    first_chunk: bytes | None  # None for non-streaming responses (the body is in `body`)
    body: bytes | None
    chunks: AsyncIterator[bytes] | None  # the remaining raw chunks of a stream
    code: str | None = None  # the error code of a non-200 body already parsed


@dataclass(frozen=True)
class _Retry:
    """An attempt that failed in a way another pod may not: why, and the retry metric's reason."""

    failure: _Failure
    reason: str
    maybe_delivered: bool  # the worker may have read the request (such failures are retried once at most)


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_BODY_BYTES:
            raise _Failure(413, f"request body larger than {_MAX_BODY_BYTES} bytes", "request_too_large")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


class ProxyEndpoint:
    """Forwards one OpenAI route (`/v1/chat/completions` or `/v1/completions`) to the workers.

    Called by `gateway.middleware.DirectRoutes` with the request's id, outside the FastAPI app and its middleware
    (see the module docstring), so it does for itself what `GatewayMiddleware` does for the other routes: every
    response carries `x-request-id`, and an unexpected exception is logged and answered with a generic 500 (or,
    after the response started, propagates so that the server cuts the connection)."""

    def __init__(self, state: GatewayState, path: str) -> None:
        self.state = state
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send, rid: bytes) -> None:
        request: _Request | None = None
        try:
            request = await self._request(scope, receive, send, rid)
            if request is not None:
                await self._serve(request, receive, send)
        except Exception:
            log.exception("%s %s failed (request id %s)", scope.get("method"), scope.get("path"), rid.decode())
            if request is not None and request.started:
                raise
            body = error_body(500, internal_error_message(rid.decode()), "internal_error")
            await send_bytes(send, 500, body, [(b"content-type", b"application/json"), (b"x-request-id", rid)])

    async def _request(self, scope: Scope, receive: Receive, send: Send, rid: bytes) -> _Request | None:
        """Authenticate and read the request; None when it was answered already (405, 401, 413, a disconnect)."""
        state = self.state
        id_header = {"x-request-id": rid.decode("latin-1")}
        if scope["method"] != "POST":
            await send_error(
                send, 405, f"{self.path} accepts POST only", "method_not_allowed", {"allow": "POST", **id_header}
            )
            return None
        arrival = time.perf_counter()
        headers = {k: v for k, v in scope["headers"] if k in (b"authorization", b"x-llmfleet-tier")}
        auth = headers.get(b"authorization")
        principal = state.keys.authenticate(auth.decode("latin-1") if auth else None)
        if principal is None:
            state.metrics.requests.labels("unknown", "", "401").inc()
            await send_error(
                send,
                401,
                "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                "invalid_api_key",
                id_header,
            )
            return None
        try:
            raw = await _read_body(receive)
        except _Disconnected:
            return None
        except _Failure as f:
            state.metrics.requests.labels("unknown", "", str(f.status)).inc()
            await send_error(send, f.status, f.message, f.code, id_header)
            return None
        return _Request(state, self.path, scope, principal, raw, headers, arrival, id_header["x-request-id"])

    async def _serve(self, request: _Request, receive: Receive, send: Send) -> None:
        watch = _DisconnectWatch(receive)
        try:
            await request.serve(send, watch)
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self.state.metrics.errors.labels(request.model_label, "client_disconnect").inc()
        finally:
            watch.stop()


class _Request:
    """One proxied request; `serve` runs it to the end."""

    def __init__(
        self,
        state: GatewayState,
        path: str,
        scope: Scope,
        principal: Principal,
        raw: bytes,
        headers: dict[bytes, bytes],
        arrival: float,
        request_id: str,
    ) -> None:
        self.state = state
        self.path = path
        self.scope = scope
        self.principal = principal
        self.raw = raw
        self.headers = headers
        self.arrival = arrival
        self.model_label = "unknown"
        self.adapter_label = ""  # the LoRA adapter's name once resolved ("" for the base model)
        self.adapter: AdapterRoute | None = None
        self.request_id = request_id
        self.response_headers: dict[str, str] = {"x-request-id": request_id}
        self.started = False  # the response has started: an error can no longer become an error response
        self.upstream_raw = raw  # the body sent upstream (streams: with stream_options.include_usage)
        self.client_wants_usage = True
        # Tokens to settle the reservation with: 0 until a worker answers 200 (nothing generated), then None
        # (unknown: the reservation stands) until the worker's usage arrives.
        self.used: int | None = 0
        self.completion_tokens: int | None = None  # from the worker's usage

    async def serve(self, send: Send, watch: _DisconnectWatch) -> None:
        metrics = self.state.metrics
        try:
            status = await self._serve(send, watch)
        except _Failure as f:
            status = f.status
            watch.finished = True
            self.started = True
            await send_error(send, f.status, f.message, f.code, {**self.response_headers, **f.headers})
        metrics.requests.labels(self.model_label, self.adapter_label, str(status)).inc()

    def _parse(self) -> tuple[dict[str, Any], str, bool]:
        try:
            body = json.loads(self.raw)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deeply to parse
            raise _Failure(
                400, "the request body is not valid JSON (or is nested too deeply)", "invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise _Failure(400, "the request body must be a JSON object", "invalid_request")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _Failure(400, "`model` is required and must be a string", "missing_model")
        return body, model, bool(body.get("stream"))

    async def _serve(self, send: Send, watch: _DisconnectWatch) -> int:
        state, s = self.state, self.state.settings
        body, model, stream = self._parse()
        key_tier = s.tier(self.principal.tier)
        header_tier = self.headers.get(b"x-llmfleet-tier")
        try:
            tier = (
                resolve_tier(s.tiers, key_tier.name, header_tier.decode("latin-1"), may_raise=self.principal.open_mode)
                if header_tier
                else key_tier
            )
            dep, suffix, adapter = resolve_model(state.table, model)
        except (TierError, RoutingError) as e:
            raise _Failure(e.status, e.message, getattr(e, "code", "invalid_tier")) from None
        self.model_label = dep.model
        if adapter is not None:
            self.adapter, self.adapter_label = adapter, adapter.name
            if not adapter.pods and any(v.ready for v in serving_variants(dep, tier.name)):
                raise self._adapter_not_ready(dep, adapter)  # pods serve the request's tier, none has it: no wait
        prompt = prompt_text(body)
        try:
            cost = request_cost(body, prompt, dep.max_model_len or s.default_max_model_len)
        except CostError as e:
            raise _Failure(400, str(e), "invalid_request") from None
        shared = self._adapter_bucket(dep, adapter)
        verdict = state.limiter.admit(self.principal.key_id, key_tier, cost.total, state.clock(), shared)
        self.response_headers = {**verdict.headers, "x-request-id": self.request_id}
        if verdict.reservation is None:
            state.metrics.rate_limited.labels(key_tier.name, verdict.limit or "").inc()
            retry = self.response_headers.pop("retry-after")
            if verdict.limit == CONCURRENCY:
                raise _Failure(
                    429,
                    f"this API key may have {key_tier.max_concurrent_requests} requests at a time in progress; "
                    "wait for one to finish",
                    "too_many_concurrent_requests",
                    {"retry-after": retry},
                )
            reserves = (
                f"this request reserves {cost.total} tokens: its prompt estimate plus max_tokens, or the rest of the "
                "context when max_tokens is absent"
            )
            if verdict.limit == ADAPTER_TOKENS and adapter is not None:
                raise _Failure(
                    429,
                    f"rate limit reached for tokens per minute of LoRA adapter {adapter.name!r} of model {dep.model!r} "
                    f"({adapter.tokens_per_minute}, shared by all API keys; {reserves}); retry after {retry}s",
                    "rate_limit_exceeded",
                    {"retry-after": retry},
                )
            raise _Failure(
                429,
                f"rate limit reached for {verdict.limit} per minute on this API key ({reserves}); retry after {retry}s",
                "rate_limit_exceeded",
                {"retry-after": retry},
            )
        try:
            raw = self.raw
            if suffix is not None:  # the worker serves the base name only (see the module docstring)
                body = {**body, "model": dep.model}
                raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            self.upstream_raw, self.client_wants_usage = upstream_body(raw, body)
            return await self._admitted(send, watch, _Routed(dep, suffix, tier, stream, prompt))
        finally:
            self._settle(verdict.reservation)

    def _adapter_bucket(self, dep: DeploymentRoute, adapter: AdapterRoute | None) -> TokenBucket | None:
        """The shared token bucket of the request's adapter (None: base model, or no `tokensPerMinute`)."""
        if adapter is None or adapter.tokens_per_minute is None:
            return None
        return self.state.limiter.adapters.get((dep.namespace, dep.name, adapter.name))

    def _adapter_not_ready(self, dep: DeploymentRoute, adapter: AdapterRoute) -> _Failure:
        """The 503 of an adapter that no pod the request may go to has loaded, with Retry-After."""
        self.state.metrics.errors.labels(self.model_label, "adapter_not_ready").inc()
        e = adapter_not_ready(dep, adapter)
        retry = _ADAPTER_FAILED_RETRY_AFTER_S if adapter.failed is not None else self.state.settings.retry_after_seconds
        return _Failure(e.status, e.message, e.code, {"retry-after": str(retry)})

    def _settle(self, reservation: Reservation) -> None:
        self.state.limiter.settle(reservation, self.used, self.state.clock())

    async def _admitted(self, send: Send, watch: _DisconnectWatch, routed: _Routed) -> int:
        state, s = self.state, self.state.settings
        try:
            await state.admission.acquire(routed.tier)
        except Rejected as r:
            state.metrics.shed.labels(routed.tier.name, r.reason).inc()
            raise _Failure(503, r.message, "overloaded", {"retry-after": str(s.retry_after_seconds)}) from None
        try:
            return await self._route_and_proxy(send, watch, routed)
        finally:
            state.admission.release()

    async def _route_and_proxy(self, send: Send, watch: _DisconnectWatch, routed: _Routed) -> int:
        state, s = self.state, self.state.settings
        dep, tier = routed.dep, routed.tier
        try:
            variant = choose_variant(dep, routed.suffix, tier.name, state.rng)
        except RoutingError as e:
            raise _Failure(e.status, e.message, e.code) from None
        if not variant.ready:
            hold_key = (dep.namespace, dep.name, variant.name)
            try:
                await state.hold.wait(hold_key, lambda: self._servable(dep.model, variant.name, tier.name), state.clock)
            except Rejected as r:
                state.metrics.shed.labels(tier.name, r.reason).inc()
                if self.adapter is not None and self._variant(dep.model, variant.name).ready:
                    raise self._adapter_not_ready(dep, self._adapter(dep.model) or self.adapter) from None
                state.metrics.errors.labels(self.model_label, "no_backend").inc()
                raise _Failure(
                    503, r.message, "no_ready_backend", {"retry-after": str(s.retry_after_seconds)}
                ) from None
        key = affinity_key(routed.prompt, s.affinity_prefix_chars)
        async with self._open(dep.model, variant.name, tier.name, key, routed.stream) as upstream:
            self.response_headers["x-llmfleet-variant"] = upstream.variant
            self.response_headers["x-llmfleet-revision"] = upstream.revision
            if upstream.first_chunk is None:
                return await self._send_whole(send, watch, upstream)
            self.used = None  # a stream was committed: from here the worker generates
            return await self._pump(send, watch, upstream)

    def _variant(self, model: str, variant: str) -> VariantRoute:
        dep = self.state.table.deployments.get(model)
        v = dep.variant(variant) if dep is not None else None
        return v if v is not None else VariantRoute(name=variant, weight=0)

    def _adapter(self, model: str) -> AdapterRoute | None:
        """The request's adapter as the routing table has it now (None: a base request, or it left the spec)."""
        if self.adapter is None:
            return None
        dep = self.state.table.deployments.get(model)
        return dep.adapters.get(self.adapter.name) if dep is not None else None

    def _servable(self, model: str, variant_name: str, tier: str) -> bool:
        """Whether a request held for a variant with no ready pod may go on: the variant has one, and for an adapter
        request, a pod it may go to has the adapter or nothing is left to wait for (it failed, or left the spec)."""
        variant = self._variant(model, variant_name)
        if not variant.ready or self.adapter is None:
            return variant.ready
        dep, adapter = self.state.table.deployments.get(model), self._adapter(model)
        if dep is None or adapter is None or adapter.failed is not None:
            return True
        return bool(adapter_endpoints(dep, variant, None, adapter, tier))

    @asynccontextmanager
    async def _open(
        self, model: str, variant_name: str, tier: str, key: str | None, stream: bool
    ) -> AsyncIterator[_Upstream]:
        """Attempts until one pod answers with a first body byte; retries only what is safe to retry.

        Yields the committed upstream; its pod's lease and its response are held until the caller's block ends.
        Each attempt leases its pod (`state.outstanding`) for exactly as long as the `with self._lease` block, so
        the lease is released in one place whatever the attempt's outcome."""
        state, s = self.state, self.state.settings
        transport = state.transport
        assert transport is not None, "the app's lifespan creates the upstream transport"
        tried: set[str] = set()
        last: _Failure | None = None
        maybe_delivered = 0  # attempts that failed after the worker may have read the request
        forward = [(k, v) for k, v in self.scope["headers"] if k in _FORWARD_REQUEST_HEADERS]
        forward.append((b"x-request-id", self.request_id.encode()))
        for attempt in range(s.max_attempts):
            ep = self._choose_endpoint(model, variant_name, tier, key, tried, first=attempt == 0)
            if ep is None:
                break
            tried.add(ep.url)
            with self._lease(ep.url):
                outcome = await self._attempt(transport, ep, forward, model, stream)
                if isinstance(outcome, _Upstream):
                    try:
                        yield outcome
                    finally:
                        await outcome.response.stream.aclose()
                    return
            last = outcome.failure
            if outcome.maybe_delivered:
                maybe_delivered += 1
                if maybe_delivered > 1:
                    break
            state.metrics.retries.labels(self.model_label, outcome.reason).inc()
        raise self._no_answer(last, model, variant_name)

    def _choose_endpoint(
        self, model: str, variant_name: str, tier: str, key: str | None, tried: set[str], *, first: bool
    ) -> Endpoint | None:
        """The pod of the next attempt, from the routing table as it is now: the first attempt keeps to the
        revision chosen by weight, a retry may take any ready pod of the variant not tried yet. An adapter request
        keeps to the pods with its adapter loaded (`adapter_endpoints`)."""
        state, s = self.state, self.state.settings
        variant = self._variant(model, variant_name)
        revision = choose_revision(variant, state.rng) if first else None
        endpoints: Sequence[Endpoint]
        if self.adapter is not None:
            dep, adapter = self.state.table.deployments.get(model), self._adapter(model)
            if dep is None or adapter is None:
                return None
            endpoints = adapter_endpoints(dep, variant, revision, adapter, tier, exclude=tried)
        elif first:
            endpoints = revision.endpoints if revision is not None else ()
        else:
            endpoints = variant.endpoints
        return choose_endpoint(endpoints, state.outstanding, key, s.load_factor, state.rng, exclude=tried)

    @contextmanager
    def _lease(self, url: str) -> Iterator[None]:
        """Counts a request outstanding on the pod (least-outstanding routing) while the block runs."""
        self.state.acquire_pod(url)
        try:
            yield
        finally:
            self.state.release_pod(url)

    async def _attempt(
        self, transport: PooledTransport, ep: Endpoint, forward: list[tuple[bytes, bytes]], model: str, stream: bool
    ) -> _Upstream | _Retry:
        """One attempt on one pod: the upstream to commit, or why to try another pod; raises `_Failure` for what
        must not be retried."""
        state, s = self.state, self.state.settings
        try:
            response = await transport.open(ep.url + self.path, forward, self.upstream_raw, state.upstream_timeouts)
        except httpx.PoolTimeout:
            state.metrics.errors.labels(self.model_label, "pool_timeout").inc()
            raise _Failure(
                503,
                "the gateway has no free upstream connection (pool.max_connections reached), retry later",
                "overloaded",
                {"retry-after": str(s.retry_after_seconds)},
            ) from None
        except _RETRYABLE_ERRORS as e:
            state.metrics.errors.labels(self.model_label, "connect").inc()
            failure = _Failure(
                502, f"could not reach a backend for {model!r}: {type(e).__name__}", "upstream_unreachable"
            )
            return _Retry(failure, "connect", maybe_delivered=isinstance(e, _MAYBE_DELIVERED_ERRORS))
        except httpx.TimeoutException as e:
            state.metrics.errors.labels(self.model_label, "timeout").inc()
            raise _Failure(
                504, f"the backend did not answer in time ({type(e).__name__})", "upstream_timeout"
            ) from None
        committed = False
        try:
            outcome = await self._first_answer(response, ep, stream)
            committed = isinstance(outcome, _Upstream)
            return outcome
        finally:
            if not committed:
                await response.stream.aclose()

    async def _first_answer(self, response: UpstreamResponse, ep: Endpoint, stream: bool) -> _Upstream | _Retry:
        """Reads a pod's answer up to its first body byte (a whole body when it is not a stream)."""
        state = self.state
        status = response.status
        chunks = aiter(response.stream)
        try:
            if status == 404 and self.adapter is not None:
                body = await read_all(response)
                code = _upstream_code(body)
                if code != "model_not_found":
                    return _Upstream(response, ep.url, ep.variant, ep.revision, None, body, None, code)
                # The status said this pod has the adapter, the worker says not (it restarted, or unloaded it since):
                # refused before its engine saw the request, so another pod may take it.
                failure = _Failure(
                    503,
                    f"LoRA adapter {self.adapter.name!r} is not loaded on the pod chosen for it (the operator is "
                    "updating its status), retry shortly",
                    "adapter_not_ready",
                    {"retry-after": str(state.settings.retry_after_seconds)},
                )
                return _Retry(failure, "adapter_missing", maybe_delivered=False)
            if status in (429, 503):
                body = await read_all(response)
                code = _upstream_code(body)
                if not retry_elsewhere(status, code):  # passed through as the worker said it
                    return _Upstream(response, ep.url, ep.variant, ep.revision, None, body, None, code)
                retry_after = header(response, b"retry-after")
                failure = _Failure(
                    status,
                    _upstream_message(body, f"backend answered {status}"),
                    "upstream_busy" if status == 429 else "upstream_unavailable",
                    {"retry-after": retry_after} if retry_after else None,
                )
                return _Retry(failure, str(status), maybe_delivered=False)
            if stream and status == 200:
                first = b""
                while not first:  # skip empty reads; an ended body yields StopAsyncIteration
                    first = await anext(chunks)
                return _Upstream(response, ep.url, ep.variant, ep.revision, first, None, chunks)
            body = await read_all(response)
            return _Upstream(response, ep.url, ep.variant, ep.revision, None, body, None)
        except StopAsyncIteration:  # a stream that ended without a byte: passed through as it is
            return _Upstream(response, ep.url, ep.variant, ep.revision, b"", None, chunks)
        except _RETRYABLE_ERRORS as e:  # failed before the first body byte: the worker may have died of it
            state.metrics.errors.labels(self.model_label, "connect").inc()
            failure = _Failure(502, f"the backend failed before answering: {type(e).__name__}", "upstream_failed")
            return _Retry(failure, "reset", maybe_delivered=True)
        except httpx.TimeoutException as e:
            state.metrics.errors.labels(self.model_label, "timeout").inc()
            raise _Failure(
                504, f"the backend did not answer in time ({type(e).__name__})", "upstream_timeout"
            ) from None

    def _no_answer(self, last: _Failure | None, model: str, variant_name: str) -> _Failure:
        """The failure of a request no attempt got an answer for: the last attempt's, or "no ready backend" (for an
        adapter request: `adapter_not_ready`)."""
        metrics, s = self.state.metrics, self.state.settings
        if last is None and self.adapter is not None:
            dep = self.state.table.deployments.get(model)
            if dep is not None:
                return self._adapter_not_ready(dep, self._adapter(model) or self.adapter)
        if last is None:
            metrics.errors.labels(self.model_label, "no_backend").inc()
            return _Failure(
                503,
                f"no ready backend for model {model!r} (variant {variant_name!r})",
                "no_ready_backend",
                {"retry-after": str(s.retry_after_seconds)},
            )
        if last.status in (429, 503):
            metrics.errors.labels(self.model_label, "upstream_status").inc()
        return last

    def _client_headers(self, response: UpstreamResponse) -> list[tuple[bytes, bytes]]:
        """The upstream's content-type, cache-control and retry-after, then the gateway's own headers."""
        content_type = b"application/json"
        hdrs: list[tuple[bytes, bytes]] = []
        for name, value in response.headers:
            lower = name.lower()
            if lower == b"content-type":
                content_type = value
            elif lower in (b"cache-control", b"retry-after") and value:
                hdrs.append((lower, value))
        hdrs.insert(0, (b"content-type", content_type))
        hdrs += [(k.encode(), v.encode()) for k, v in self.response_headers.items()]
        return hdrs

    async def _send_whole(self, send: Send, watch: _DisconnectWatch, up: _Upstream) -> int:
        body = up.body or b""
        status = up.response.status
        if status == 200:
            usage = usage_of_body(body)
            self.used = usage.total if usage is not None else None
            if usage is not None:
                self.state.metrics.output_tokens.labels(self.model_label, self.adapter_label).inc(
                    usage.completion_tokens
                )
        else:
            self.state.metrics.errors.labels(self.model_label, "upstream_status").inc()
        watch.finished = True
        self.started = True
        await send_bytes(send, status, body, self._client_headers(up.response))
        return status

    def _usage_from(self, chunk: bytes, strip: bool) -> bytes:
        """Settle from the usage in `chunk` (whole SSE lines, holding the usage marker) and return what the client
        gets of it."""
        if strip:
            chunk = strip_null_usage(chunk)
        if not has_usage(chunk):
            return chunk
        chunk, usage = take_usage(chunk, strip)
        if usage is not None:
            self.used = usage.total
            self.completion_tokens = usage.completion_tokens
            self.state.metrics.output_tokens.labels(self.model_label, self.adapter_label).inc(usage.completion_tokens)
        return chunk

    def _observe_itl(self, first: float, reads: int) -> None:
        """One observation per stream: its mean time per output token after the first (by the worker's usage;
        without usage, per upstream read)."""
        tokens = self.completion_tokens if self.completion_tokens is not None else reads
        if tokens > 1:
            self.state.metrics.itl.labels(self.model_label).observe((time.perf_counter() - first) / (tokens - 1))

    async def _pump(self, send: Send, watch: _DisconnectWatch, up: _Upstream) -> int:
        """Stream the upstream body to the client chunk by chunk; never retried from here on.

        Per chunk: a partial last line is held back for the next read (an SSE client can do nothing with it
        before it completes), so every chunk looked at holds whole lines; only a chunk holding `"usage":` is
        looked at further. No metric is touched per chunk: the stream's inter-token latency is observed once at
        its end."""
        state = self.state
        metrics = state.metrics
        read_timeout = state.settings.timeouts.read
        strip = not self.client_wants_usage
        chunks = up.chunks
        status = up.response.status
        self.started = True
        await send({"type": "http.response.start", "status": status, "headers": self._client_headers(up.response)})
        chunk = up.first_chunk or b""
        first = time.perf_counter()
        if chunk:
            metrics.ttft.labels(self.model_label).observe(first - self.arrival)
        reads = 0
        pending = b""
        ended_clean = True
        if chunks is not None:  # from here on, each read waits `read` seconds at most (the first waited first_byte)
            up.response.stream.set_read_timeout(read_timeout)
        try:
            while True:
                if pending:
                    chunk, pending = pending + chunk, b""
                if chunk and chunk[-1] != 10:  # not ending in b"\n": hold the partial line back
                    cut = chunk.rfind(b"\n") + 1
                    if cut or len(chunk) <= _MAX_PENDING_BYTES:
                        chunk, pending = chunk[:cut], chunk[cut:]
                if chunk:
                    if _USAGE_KEY in chunk:
                        chunk = self._usage_from(chunk, strip)
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        ended_clean = chunk.endswith(b"\n\n")
                failure: str | None = None
                try:
                    chunk = await anext(chunks)  # type: ignore[arg-type]
                except StopAsyncIteration:
                    if not pending:
                        break
                    chunk, pending = pending, b""  # an unterminated last line: passed on as it is
                    if _USAGE_KEY in chunk:
                        chunk = self._usage_from(chunk, strip)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    break
                except httpx.ReadTimeout:
                    failure = f"no data for {read_timeout:g} s"
                except httpx.HTTPError as e:
                    failure = type(e).__name__
                if failure is not None:
                    metrics.errors.labels(self.model_label, "midstream").inc()
                    msg = f"the backend failed mid-stream ({failure}); the response is incomplete"
                    event = sse_error_event(502, msg, "upstream_failed_midstream")
                    watch.finished = True
                    body = event if ended_clean else b"\n\n" + event
                    await send({"type": "http.response.body", "body": body, "more_body": False})
                    return 502
                reads += 1
        finally:
            self._observe_itl(first, reads)
        watch.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return status


def _upstream_message(body: bytes, default: str) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return default


def _upstream_code(body: bytes) -> str | None:
    """`error.code` of an upstream error body, None when it has none."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError, RecursionError):
        return None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None
