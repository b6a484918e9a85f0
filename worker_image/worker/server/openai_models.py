"""OpenAI API shapes: request models (validated with clear messages) and builders of responses and stream chunks.

Requests are pydantic models so FastAPI documents them and every bad field becomes an OpenAI-style 400 naming the
field. Responses are built as plain dicts (no per-chunk model validation on the hot streaming path); their shapes
are what the official `openai` SDK parses, and the tests check them through that SDK.

Supported beyond the plain sampling fields: `stop`, `seed`, `stream_options.include_usage`, `logprobs`
(completions `logprobs=k`: each chosen token's log probability and its k most likely alternatives; chat
`logprobs=true` with `top_logprobs=k`), completions `echo` (the prompt is returned before the completion, and with
`logprobs` every prompt token after the first is scored too: teacher-forced scoring, as the legacy OpenAI API and
vLLM do it; the canary quality probe relies on it), and vLLM's extensions `top_k`, `min_tokens`, `ignore_eos`,
`stop_token_ids`, `priority`, and `logit_bias`. Tokens in logprobs are named `token_id:N` (vLLM's
`return_tokens_as_token_ids` format). Fields this server cannot honour (n > 1, penalties, tools, suffix,
best_of > 1, JSON response formats) are rejected with a 400 that says so instead of being silently ignored.
Unknown fields are ignored, as OpenAI-compatible servers do.

Every field is bounded here (the limits are `worker.core.request`'s, shared with `SamplingParams`), so a request
either gets a 400 naming the field or carries values the engine can run: one request's parameters can fail
that request only, never the engine and the requests batched with it.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from worker.core.request import (
    LOGIT_BIAS_LIMIT,
    MAX_INT32,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOP_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    FinishReason,
    Logprob,
    SamplingParams,
)

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def unicode_text(value: str) -> str:
    """Text must be valid Unicode: JSON can carry lone surrogates (`"\\ud800"`), which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"text must be valid Unicode; found a lone surrogate at position {err.start}") from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=MAX_TOKEN_ID, description="vLLM extension; 0 or -1 disables it")
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    n: int = 1
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(
        None, description=f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters"
    )
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, le=2, allow_inf_nan=False, description="vLLM extension")
    logit_bias: dict[str, float] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS_ENTRIES,
        description=f"token id (as a string) -> bias in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
    )
    user: Text | None = None
    priority: int = Field(
        0, ge=-MAX_INT32 - 1, le=MAX_INT32, description="lower is served first (vLLM extension; the gateway's tiers)"
    )

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                f"n={value} is not supported: this server returns exactly one choice (n=1); "
                "send separate requests instead"
            )
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0:
            raise ValueError("presence and frequency penalties are not supported by this server; leave them at 0")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, value: float) -> float:
        if value != 1:
            raise ValueError("repetition_penalty is not supported by this server; leave it at 1")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids written in decimal; values in [-100, 100]. Whether each id is in the model's
        vocabulary is checked when the engine admits the request."""
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= MAX_TOKEN_ID):
                raise ValueError(f"logit_bias keys must be token ids (0..{MAX_TOKEN_ID} in decimal), got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:  # NaN fails this too
                raise ValueError(
                    f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                    f"got {bias} for token {key}"
                )
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        for stop in stops:
            unicode_text(stop)
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {longest}")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def wants_logprobs(self) -> bool:
        raise NotImplementedError

    def num_top_logprobs(self) -> int:
        """Alternatives asked for each chosen token (0: the chosen token's logprob only)."""
        return 0

    def num_prompt_logprobs(self) -> int | None:
        """None: no prompt scoring; k: score the prompt tokens, with k alternatives each."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters; raises ValueError (-> 400) on a combination the engine rejects."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.wants_logprobs(),
            min_tokens=self.min_tokens,
            top_logprobs=self.num_top_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
        )


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] = Field(description="a string or token ids; a one-element batch is accepted")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        """One prompt: a string or a list of non-negative token ids (OpenAI's batch forms with one element too)."""
        if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
            if len(value) != 1:
                raise ValueError(
                    f"batched prompts ({len(value)} prompts) are not supported: send one prompt per request"
                )
            value = value[0]
        if isinstance(value, str):
            return unicode_text(value)
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if not value:
                raise ValueError("prompt must not be empty")
            if min(value) < 0 or max(value) > MAX_TOKEN_ID:
                bad = min(value) if min(value) < 0 else max(value)
                raise ValueError(
                    f"token ids must be non-negative and at most {MAX_TOKEN_ID} (and in the model's "
                    f"vocabulary), got {bad}"
                )
            return value
        raise ValueError("prompt must be a string or a list of token ids (non-negative integers)")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix (insertion) is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"best_of={value} is not supported: only 1")
        return value

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo and self.logprobs is not None else None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Text | None = None

    @field_validator("content")
    @classmethod
    def _unicode_content(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        for text in [value] if isinstance(value, str) else [part.text for part in value or []]:
            unicode_text(text)
        return value

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it: text parts joined, no None content."""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
        return self

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise ValueError("tools (function calling) are not supported by this server")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and value.get("type") != "text":
            raise ValueError(f"response_format {value.get('type')!r} is not supported: only 'text'")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


# ---- responses -------------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def token_label(token_id: int) -> str:
    """How a token appears in logprobs: the engine interface has no per-token decode, so tokens are named by id
    (vLLM's `return_tokens_as_token_ids` format)."""
    return f"token_id:{token_id}"


def completion_logprobs(token_ids: list[int], logprobs: list[Logprob | None], with_top: bool) -> dict[str, Any]:
    """Completions-API logprobs of `token_ids`; None entries (the first prompt token under `echo`) stay None.
    `top_logprobs` maps token labels to logprobs per position, when alternatives were asked for."""
    top = None
    if with_top:
        top = [None if lp is None else {token_label(t): v for t, v in lp.top} for lp in logprobs]
    return {
        "tokens": [token_label(t) for t in token_ids],
        "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
        "top_logprobs": top,
        "text_offset": None,
    }


def chat_logprobs(token_ids: list[int], logprobs: list[Logprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": token_label(t),
                "logprob": lp.logprob,
                "bytes": None,
                "top_logprobs": [{"token": token_label(a), "logprob": v, "bytes": None} for a, v in lp.top],
            }
            for t, lp in zip(token_ids, logprobs, strict=True)
        ]
    }


def _reason(reason: FinishReason | None) -> str | None:
    return reason.value if reason is not None else None


def now_created() -> int:
    return int(time.time())


def completion_response(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: FinishReason | None,
    usage_body: dict[str, Any],
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": _reason(finish_reason), "logprobs": logprobs}],
        "usage": usage_body,
    }


def chat_response(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: FinishReason | None,
    usage_body: dict[str, Any],
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": _reason(finish_reason),
                "logprobs": logprobs,
            }
        ],
        "usage": usage_body,
    }


def _stream_chunk(
    request_id: str, obj: str, model: str, created: int, choice: dict[str, Any], with_usage_field: bool
) -> dict[str, Any]:
    """One streamed chunk with one choice; `usage: null` on every chunk but the last when include_usage is on."""
    chunk: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: FinishReason | None,
    logprobs: dict[str, Any] | None,
    with_usage_field: bool,
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": _reason(finish_reason), "logprobs": logprobs}
    return _stream_chunk(request_id, "text_completion", model, created, choice, with_usage_field)


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: FinishReason | None,
    logprobs: dict[str, Any] | None,
    with_usage_field: bool,
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": _reason(finish_reason), "logprobs": logprobs}
    return _stream_chunk(request_id, "chat.completion.chunk", model, created, choice, with_usage_field)


def usage_chunk(request_id: str, obj: str, model: str, created: int, usage_body: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with `include_usage`: no choices, the totals."""
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_body}


def models_list(model: str, created: int, max_model_len: int, adapters: dict[str, str] | None = None) -> dict[str, Any]:
    """The base model, then each LoRA adapter (name -> folder) as vLLM lists them: `root` its folder, `parent`
    the base model."""
    data = [
        {"id": model, "object": "model", "created": created, "owned_by": "llmfleet", "max_model_len": max_model_len}
    ]
    for name, path in sorted((adapters or {}).items()):
        data.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "llmfleet",
                "root": path,
                "parent": model,
                "max_model_len": max_model_len,
            }
        )
    return {"object": "list", "data": data}


class LoadLoraAdapterRequest(BaseModel):
    """`POST /v1/load_lora_adapter` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(BaseModel):
    """`POST /v1/unload_lora_adapter` (vLLM's body; its optional `lora_int_id` is accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
