"""Client traffic for the local fleet: one streamed chat answer, and a bounded load generator with a tally.

Why it exists: `llmfleet up` streams a real answer through the gateway, the `--scenario` tour drives load bursts,
and the e2e suite counts streams that completed or broke while pods roll, drain or die. All of them speak the
OpenAI streaming protocol over plain httpx (SSE `data:` lines ending with `[DONE]`).

`StreamLoad` is bounded in requests and in time: `workers` threads each stream one request after another until
`stop()`, `max_requests` in all, or `deadline_s`. A stream counts as complete only when it ends with `[DONE]` after
a `finish_reason` of `stop` or `length`; anything else is a failure, classified as `before_first_byte` (an HTTP
error status or a connection error: nothing reached the client) or `mid_stream` (the stream started then broke).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx


class ChatError(RuntimeError):
    """The gateway answered with an error status or a malformed stream."""


def chat_body(model: str, prompt: str, max_tokens: int, temperature: float = 0.0) -> dict[str, Any]:
    return {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "messages": [{"role": "user", "content": prompt}],
    }


def sse_payloads(lines: Iterator[str]) -> Iterator[dict[str, Any] | None]:
    """The JSON payloads of SSE `data:` lines; None for the final `[DONE]` (after which nothing is read)."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            yield None
            return
        yield json.loads(data)


def stream_chat(
    base_url: str, api_key: str | None, model: str, prompt: str, max_tokens: int = 64, timeout_s: float = 120.0
) -> Iterator[str]:
    """Stream one greedy chat answer through the gateway, yielding text pieces as they arrive."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with (
        httpx.Client(timeout=timeout_s, trust_env=False) as client,
        client.stream(
            "POST", f"{base_url}/v1/chat/completions", json=chat_body(model, prompt, max_tokens), headers=headers
        ) as response,
    ):
        if response.status_code != 200:
            raise ChatError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:500]}")
        for payload in sse_payloads(response.iter_lines()):
            if payload is None:
                return
            for choice in payload.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    yield piece
    raise ChatError("the stream ended without [DONE]")


@dataclass(frozen=True)
class Outcome:
    """One request of a load run."""

    started: float  # time.monotonic() when sent
    ended: float
    ok: bool
    kind: str  # "ok", "before_first_byte" or "mid_stream"
    detail: str = ""
    revision: str = "?"
    variant: str = "?"
    ttft_s: float | None = None


def classify_stream(lines: Iterator[str]) -> tuple[str, str, float | None]:
    """(kind, detail, seconds to first content) of one streamed 200 response, reading it to the end."""
    started = time.monotonic()
    first: float | None = None
    finish, done = None, False
    try:
        for payload in sse_payloads(lines):
            if payload is None:
                done = True
                break
            choice = (payload.get("choices") or [{}])[0]
            if first is None and (choice.get("delta") or {}).get("content"):
                first = time.monotonic() - started
            finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, ValueError) as error:
        return "mid_stream", f"{type(error).__name__}: {error}", first
    if not done or finish not in ("stop", "length"):
        return "mid_stream", f"stream ended early (finish_reason {finish}, [DONE] {done})", first
    return "ok", "", first


@dataclass
class StreamLoad:
    """A bounded load generator; see the module docstring. Use as a context manager or start()/stop()."""

    url: str
    api_key: str | None
    model: str
    workers: int = 3
    max_requests: int = 2000
    deadline_s: float = 180.0
    max_tokens: int = 24
    prompt: str = "Tell me a short story about a lighthouse."
    outcomes: list[Outcome] = field(default_factory=list)
    _sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _deadline: float = 0.0

    def start(self) -> StreamLoad:
        self._deadline = time.monotonic() + self.deadline_s
        self._threads = [threading.Thread(target=self._run, name=f"load-{i}", daemon=True) for i in range(self.workers)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def __enter__(self) -> StreamLoad:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # ----------------------------------------------------------------------------------------------- tallies

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    @property
    def completed(self) -> int:
        return sum(1 for o in self.snapshot() if o.ok)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.snapshot() if not o.ok]

    def revisions(self) -> Counter[str]:
        return Counter(o.revision for o in self.snapshot() if o.ok)

    def summary(self) -> str:
        outcomes = self.snapshot()
        kinds = Counter(o.kind for o in outcomes)
        ttfts = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
        p50 = f"{ttfts[len(ttfts) // 2] * 1000:.0f} ms" if ttfts else "n/a"
        return (
            f"{len(outcomes)} streams: {kinds['ok']} ok, {kinds['before_first_byte']} failed before the first "
            f"byte, {kinds['mid_stream']} broke mid-stream; TTFT p50 {p50}"
        )

    # ------------------------------------------------------------------------------------------------- work

    def _take(self) -> bool:
        with self._lock:
            if self._stop.is_set() or self._sent >= self.max_requests or time.monotonic() > self._deadline:
                return False
            self._sent += 1
            return True

    def _run(self) -> None:
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = chat_body(self.model, self.prompt, self.max_tokens, temperature=0.7)
        with httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0), trust_env=False) as client:
            while self._take():
                outcome = self._one(client, body, headers)
                with self._lock:
                    self.outcomes.append(outcome)
                if outcome.kind == "before_first_byte":
                    self._stop.wait(0.2)  # an error answer is instant: do not spin

    def _one(self, client: httpx.Client, body: dict[str, Any], headers: dict[str, str]) -> Outcome:
        started = time.monotonic()
        revision = variant = "?"
        try:
            with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=headers) as response:
                revision = response.headers.get("x-llmfleet-revision", "?")
                variant = response.headers.get("x-llmfleet-variant", "?")
                if response.status_code != 200:
                    detail = response.read().decode(errors="replace")[:300]
                    return Outcome(
                        started,
                        time.monotonic(),
                        False,
                        "before_first_byte",
                        f"HTTP {response.status_code}: {detail}",
                        revision,
                        variant,
                    )
                kind, detail, ttft = classify_stream(response.iter_lines())
        except httpx.HTTPError as error:
            return Outcome(
                started,
                time.monotonic(),
                False,
                "before_first_byte",
                f"{type(error).__name__}: {error}",
                revision,
                variant,
            )
        return Outcome(started, time.monotonic(), kind == "ok", kind, detail, revision, variant, ttft)
