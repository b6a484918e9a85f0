"""The quality probe: the fixed prompts sent greedily to one stable and one canary pod, tokens compared.

Why it exists: when a rollout changes a variant's quantization, fast-but-wrong is the failure that latency and
error metrics cannot see. The operator calls `run_probe` with the two pods' base URLs during canary analysis and
passes `ProbeResult.agreement` to `controllers.analysis.analyse` (None there makes the check Inconclusive).

How tokens are obtained: each prompt of `controllers.quality.PROBE_PROMPTS` goes to `POST /v1/completions` with
`temperature: 0` (greedy), a small `max_tokens`, a fixed `seed`, and `logprobs: 0`, which makes the server return
the chosen tokens in `choices[0].logprobs.tokens`. llmfleet's worker names them by id (`token_id:123`, vLLM's
`return_tokens_as_token_ids` format); vLLM's own server returns the decoded token strings. Either way both pods run
the same model and tokenizer and answer in the same format, so comparing the token lists position by position is
exact: no re-tokenising of text, no whitespace heuristics. A server that returns no token list makes the probe
fail (None), never guess.

Each prompt is sent to both pods at the same time and prompts go one after another, so the probe adds at most
one request per pod at a time. Probe requests are ordinary requests to the workers: they show in the pods'
request counters (a handful per check). Any failure (connection, status, timeout, malformed answer) ends the
probe with `agreement=None` and a `detail` saying which pod failed how; it never raises.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from controllers.quality import PROBE_MAX_TOKENS, PROBE_PROMPTS, token_agreement

log = logging.getLogger(__name__)

PROBE_USER = "llmfleet-quality-probe"


@dataclass(frozen=True)
class ProbeResult:
    """Agreement in 0..1 (None when the probe failed or produced no tokens) and a human-readable detail."""

    agreement: float | None
    detail: str


class ProbeError(Exception):
    """One probe request failed; the message names the pod and the cause."""


def completion_request(prompt: str, max_tokens: int, model: str | None) -> dict[str, Any]:
    """The greedy completion request body sent for one probe prompt."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "logprobs": 0,
        "stream": False,
        "user": PROBE_USER,
    }
    if model is not None:
        body["model"] = model
    return body


def response_tokens(body: Any) -> list[str]:
    """The generated tokens of a completion response (`choices[0].logprobs.tokens`); ValueError when absent."""
    try:
        tokens = body["choices"][0]["logprobs"]["tokens"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("the response has no choices[0].logprobs.tokens (does the server support logprobs?)") from None
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("choices[0].logprobs.tokens is not a list of strings")
    return tokens


async def _complete(client: httpx.AsyncClient, role: str, base_url: str, body: dict[str, Any]) -> list[str]:
    url = f"{base_url.rstrip('/')}/v1/completions"
    try:
        response = await client.post(url, json=body)
    except Exception as error:  # noqa: BLE001 - connection, timeout, bad URL: the probe failed, never raise
        raise ProbeError(f"{role} pod {base_url}: {type(error).__name__}: {error}") from None
    if response.status_code != 200:
        raise ProbeError(f"{role} pod {base_url}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        body = response.json()
    except ValueError as error:
        raise ProbeError(f"{role} pod {base_url}: the response is not JSON ({error})") from None
    try:
        return response_tokens(body)
    except ValueError as error:
        raise ProbeError(f"{role} pod {base_url}: {error}") from None


async def run_probe(
    stable_url: str,
    canary_url: str,
    *,
    model: str | None = None,
    prompts: Sequence[str] = PROBE_PROMPTS,
    max_tokens: int = PROBE_MAX_TOKENS,
    timeout_s: float = 60.0,
    client: httpx.AsyncClient | None = None,
) -> ProbeResult:
    """Greedy token agreement of the canary pod at `canary_url` against the stable pod at `stable_url`.

    `model` is the served model name (omitted from requests when None: the worker then serves its only model).
    """
    if not prompts:
        raise ValueError("the quality probe needs at least one prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout_s)
    stable_tokens: list[list[str]] = []
    canary_tokens: list[list[str]] = []
    try:
        for prompt in prompts:
            body = completion_request(prompt, max_tokens, model)
            answers = await asyncio.gather(
                _complete(http, "stable", stable_url, body),
                _complete(http, "canary", canary_url, body),
                return_exceptions=True,  # both requests finish before the client may close
            )
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
            stable, canary = answers
            stable_tokens.append(stable)  # type: ignore[arg-type]
            canary_tokens.append(canary)  # type: ignore[arg-type]
    except ProbeError as error:
        log.warning("quality probe failed: %s", error)
        return ProbeResult(None, f"quality probe failed: {error}")
    finally:
        if own:
            await http.aclose()
    agreement = token_agreement(stable_tokens, canary_tokens)
    return ProbeResult(agreement.value, f"quality probe: {agreement.describe()}")
