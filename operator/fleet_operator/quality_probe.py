"""The quality probe: the canary scores, teacher-forced, what the stable revision generates greedily.

Why it exists: when a rollout changes a variant's quantization, fast-but-wrong is the failure that latency and
error metrics cannot see. The operator calls `run_probe` with one stable and one canary pod's base URL during
canary analysis and passes `ProbeResult.agreement` to `controllers.analysis.analyse` (None there makes the check
Inconclusive). The measure is defined in `controllers.quality`.

Per prompt of `controllers.quality.PROBE_PROMPTS`, two requests to `POST /v1/completions`:
1. stable: the prompt text, greedy (`temperature: 0`), `max_tokens` tokens, `echo: true` and `logprobs: 0`: the
   answer's `logprobs.tokens` hold the prompt's tokens followed by the continuation's, and `usage.prompt_tokens`
   says where the continuation starts.
2. canary: that whole token sequence as a token-id prompt, `echo: true`, `logprobs: 1`, `max_tokens: 1`: its
   `logprobs.top_logprobs` give, at every position, the canary's most likely next token given the exact same
   prefix (teacher forcing). The canary's argmax at each continuation position is compared with stable's token.
Tokens are named by id (`token_id:N`): that is how llmfleet's worker labels them, with either engine backend
(vLLM's `return_tokens_as_token_ids` format), so the canary's prompt is rebuilt exactly, with no re-tokenising of
text. A server that labels tokens otherwise fails the probe (None) with a detail saying so; it never guesses.

Why teacher-forced: comparing two free-running greedy generations turns one early near-tie flip into a whole lost
sequence, so the number measured how far two texts run together rather than how often the canary's next-token
choice matches (SmolLM2-135M int4 vs fp32 on these prompts: 0.60-0.69 free-running, 0.98-0.99 teacher-forced).

Prompts go one after another (one stable, then one canary request), so the probe adds at most one request per pod
at a time. Probe requests are ordinary requests to the workers (they show in the pods' request counters). Any
failure (connection, status, timeout, malformed answer) ends the probe with `agreement=None` and a `detail` that
names the pod and the cause; it never raises.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from controllers.quality import PROBE_MAX_TOKENS, PROBE_PROMPTS, Scored, parse_token_id, token_agreement

log = logging.getLogger(__name__)

PROBE_USER = "llmfleet-quality-probe"


@dataclass(frozen=True)
class ProbeResult:
    """Agreement in 0..1 (None when the probe failed or produced no tokens) and a human-readable detail."""

    agreement: float | None
    detail: str


class ProbeError(Exception):
    """One probe request failed; the message names the pod and the cause."""


def _request(prompt: str | list[int], max_tokens: int, logprobs: int, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "echo": True,
        "logprobs": logprobs,
        "stream": False,
        "user": PROBE_USER,
    }
    if model is not None:
        body["model"] = model
    return body


def generate_request(prompt: str, max_tokens: int, model: str | None) -> dict[str, Any]:
    """Step 1 (stable pod): greedy continuation, prompt echoed, tokens named."""
    return _request(prompt, max_tokens, 0, model)


def score_request(token_ids: list[int], model: str | None) -> dict[str, Any]:
    """Step 2 (canary pod): score a token sequence, with the top-1 token at every position."""
    return _request(token_ids, 1, 1, model)


def _logprobs(body: Any) -> dict[str, Any]:
    try:
        logprobs = body["choices"][0]["logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ValueError("the response has no choices[0].logprobs") from None
    if not isinstance(logprobs, dict):
        raise ValueError("choices[0].logprobs is missing (does the server support logprobs with echo?)")
    return logprobs


def generated(body: Any) -> Scored:
    """Step 1's answer: (all token ids, how many of them are the prompt). ValueError when malformed."""
    tokens = _logprobs(body).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("choices[0].logprobs.tokens is not a list of strings")
    try:
        num_prompt = int(body["usage"]["prompt_tokens"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("the response has no usage.prompt_tokens") from None
    if not 0 < num_prompt <= len(tokens):
        raise ValueError(f"usage.prompt_tokens={num_prompt} but {len(tokens)} tokens were echoed: is echo ignored?")
    return Scored([parse_token_id(t) for t in tokens], num_prompt)


def argmax_tokens(body: Any, num_tokens: int) -> list[int | None]:
    """Step 2's answer: the most likely token at each of the first `num_tokens` positions (None at the first,
    which has no context). ValueError when malformed."""
    top = _logprobs(body).get("top_logprobs")
    if not isinstance(top, list) or len(top) < num_tokens:
        raise ValueError(
            f"choices[0].logprobs.top_logprobs must list at least {num_tokens} positions (echo + logprobs=1)"
        )
    best: list[int | None] = [None]
    for position, entry in enumerate(top[1:num_tokens], start=1):
        if not isinstance(entry, dict) or not entry:
            raise ValueError(f"choices[0].logprobs.top_logprobs[{position}] is not a non-empty object")
        label = max(entry, key=lambda k: entry[k])
        best.append(parse_token_id(label))
    return best


async def _post(client: httpx.AsyncClient, role: str, base_url: str, body: dict[str, Any]) -> Any:
    url = f"{base_url.rstrip('/')}/v1/completions"
    try:
        response = await client.post(url, json=body)
    except Exception as error:  # noqa: BLE001 - connection, timeout, bad URL: the probe failed, never raise
        raise ProbeError(f"{role} pod {base_url}: {type(error).__name__}: {error}") from None
    if response.status_code != 200:
        raise ProbeError(f"{role} pod {base_url}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError as error:
        raise ProbeError(f"{role} pod {base_url}: the response is not JSON ({error})") from None


async def _probe_one(
    client: httpx.AsyncClient, stable_url: str, canary_url: str, prompt: str, max_tokens: int, model: str | None
) -> tuple[list[int], list[int | None]]:
    """(stable's continuation, the canary's argmax at each of its positions) for one prompt."""
    body = await _post(client, "stable", stable_url, generate_request(prompt, max_tokens, model))
    try:
        sequence = generated(body)
    except ValueError as error:
        raise ProbeError(f"stable pod {stable_url}: {error}") from None
    if not sequence.continuation:
        return [], []
    body = await _post(client, "canary", canary_url, score_request(sequence.token_ids, model))
    try:
        best = argmax_tokens(body, len(sequence.token_ids))
    except ValueError as error:
        raise ProbeError(f"canary pod {canary_url}: {error}") from None
    return sequence.continuation, best[sequence.num_prompt :]


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
    """Teacher-forced greedy agreement of the canary pod at `canary_url` with the stable pod at `stable_url`.

    `model` is the served model name (omitted from requests when None: the worker then serves its only model).
    """
    if not prompts:
        raise ValueError("the quality probe needs at least one prompt")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    own = client is None
    http = client or httpx.AsyncClient(timeout=timeout_s)
    stable_tokens: list[list[int]] = []
    canary_tokens: list[list[int | None]] = []
    try:
        for prompt in prompts:
            stable, canary = await _probe_one(http, stable_url, canary_url, prompt, max_tokens, model)
            stable_tokens.append(stable)
            canary_tokens.append(canary)
    except ProbeError as error:
        log.warning("quality probe failed: %s", error)
        return ProbeResult(None, f"quality probe failed: {error}")
    finally:
        if own:
            await http.aclose()
    agreement = token_agreement(stable_tokens, canary_tokens)
    return ProbeResult(agreement.value, f"quality probe (teacher-forced): {agreement.describe()}")
