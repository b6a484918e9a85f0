"""Tokenizer, chat template and incremental detokenization from a model folder, without `transformers`.

`tokenizer.json` is run by the `tokenizers` library; the chat template (`tokenizer_config.json`'s
`chat_template`, or a `chat_template.jinja` file) is rendered with jinja2 in a sandbox configured like HF's
(`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`), so templates written for HF render the same.
`IncrementalDetokenizer` turns a growing list of ids into text deltas the way vLLM's `detokenize_incrementally`
does (prefix/read offsets), never emitting half of a multi-byte character.

Encoding goes through `encode_batch`, which releases the GIL (`encode` holds it for the whole call: a 16 MB text
froze every other thread for 8 s), so a server may tokenize on a worker thread and keep answering.
`max_bytes_per_token` derives, from `tokenizer.json`, how many bytes of text one token can stand for at most: a
prompt of B bytes then has at least ceil(B / bound) tokens, which lets a server refuse an over-long prompt
before paying for its tokenization.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"


def _token_text(value: Any) -> str | None:
    """`tokenizer_config.json` spells special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Pre-tokenizers that only cut the text into pieces (a `Removed` behaviour drops the matches: not allowed).
_CUTTING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Digits", "Metaspace", "Punctuation", "Split", "UnicodeScripts"})
_UTF8_MAX_BYTES_PER_CHAR = 4


def _pre_tokenizers(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [p for inner in spec.get("pretokenizers", []) for p in _pre_tokenizers(inner)]
    return [spec]


def max_bytes_per_token(spec: dict[str, Any]) -> int | None:
    """The most UTF-8 bytes of input text that one token can stand for, from a `tokenizer.json` (as a dict); None
    when no such bound follows from the tokenizer's definition.

    Why it is a bound: with no normalizer and no truncation, the text reaches the pre-tokenizers unchanged; the
    allowed ones only cut it into pieces; a BPE model turns each piece into vocabulary tokens whose strings
    concatenate back to it. So a token stands for as many input bytes as its vocabulary string holds: one per
    character in a byte-level vocabulary (each character maps one byte), at most its UTF-8 length otherwise
    (Metaspace's "▁" is 3 bytes for a 1-byte space, byte-fallback "<0x41>" 6 bytes for 1). An added token stands
    for its content, unless it swallows neighbouring whitespace (lstrip/rstrip: no bound); an unknown character
    is one token of at most 4 bytes, unless unknowns are fused (no bound). Special tokens a post-processor adds
    only add tokens. Anything else (a normalizer, a dropping pre-tokenizer, WordPiece, Unigram): None.
    """
    model = spec.get("model") or {}
    if spec.get("normalizer") is not None or spec.get("truncation") is not None or model.get("type") != "BPE":
        return None
    pre = _pre_tokenizers(spec.get("pre_tokenizer"))
    if any(
        p.get("type") not in _CUTTING_PRE_TOKENIZERS or str(p.get("behavior", "")).lower() == "removed" for p in pre
    ):
        return None
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    vocab = model.get("vocab") or {}
    longest = max((len(s) if byte_level else len(s.encode()) for s in vocab), default=1)
    if model.get("unk_token") is not None:
        if model.get("fuse_unk"):
            return None
        longest = max(longest, _UTF8_MAX_BYTES_PER_CHAR)
    return max([longest, *(len(str(token.get("content", "")).encode()) for token in added)])


class Tokenizer:
    """Encode/decode text and render chat prompts for one model folder."""

    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the builtin engine needs a fast-tokenizer tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        self.max_bytes_per_token = max_bytes_per_token(json.loads(path.read_text()))
        cfg_path = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.eos_token_id = self._eos_id(root)
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        self._special_tokens = {k: _token_text(cfg.get(k)) for k in names}
        self._template = None
        if template is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(template)

    def _eos_id(self, root: Path) -> int | None:
        if self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            if tid is not None:
                return tid
        for name in ("generation_config.json", "config.json"):
            path = root / name
            if path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                if isinstance(eos, list) and eos:
                    return int(eos[0])
                if isinstance(eos, int):
                    return eos
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids  # GIL released
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template: send a plain completion prompt instead")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self._special_tokens.items() if v is not None},
        )


class Decoder(Protocol):
    """All that incremental detokenization needs of a tokenizer."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for a growing token list (prefix/read offsets as in vLLM's `detokenize_incrementally`).

    `prefix_offset..read_offset` are tokens already turned into text, decoded again as left context so that
    tokenizers which change a token's text depending on its neighbours (leading spaces) decode consistently. A
    delta ending in U+FFFD (an incomplete UTF-8 sequence) is held back until more tokens complete it, but never
    more than `MAX_HELD_TOKENS`: a stream of bytes that never form a character (a model, or a request's
    `logit_bias`, choosing lone continuation bytes) would otherwise be decoded again whole at every step, O(n^2)
    over the output on the engine's thread (2,048 such tokens: 166 ms; with the bound: linear). Past the bound
    the held text is sent as it decodes, U+FFFD included, as `flush` would; no real character spans 64 tokens.
    """

    CONTEXT_TOKENS = 5
    MAX_HELD_TOKENS = 64

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly completed text (may be empty)."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self._ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and len(self._ids) - self.read_offset < self.MAX_HELD_TOKENS:
            return ""
        delta = full_text[len(prefix_text) :]
        held = len(self._ids) - self.read_offset
        self.prefix_offset = self.read_offset if held < self.MAX_HELD_TOKENS else len(self._ids) - self.CONTEXT_TOKENS
        self.read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self._ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self._ids)
        self.text += delta
        return delta
