"""Tokenizer, chat template and incremental detokenization from a model folder, without `transformers`.

`tokenizer.json` is run by the `tokenizers` library; the chat template (`tokenizer_config.json`'s
`chat_template`, or a `chat_template.jinja` file) is rendered with jinja2 in a sandbox configured like HF's
(`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`), so templates written for HF render the same.
`IncrementalDetokenizer` turns a growing list of ids into text deltas the way vLLM's `detokenize_incrementally`
does (prefix/read offsets), never emitting half of a multi-byte character. It runs on the engine's thread once
per token of every running request, so `Tokenizer.decode_stream` gives it a faster path: for byte-level
tokenizers a table of each token's bytes and an incremental UTF-8 decoder (`ByteLevelDetokenizer`, which
`incremental_detokenizer` hands a request directly where it can: one call a token), for others `tokenizers`'
DecodeStream.

Encoding goes through `encode_batch`, which releases the GIL (`encode` holds it for the whole call: a 16 MB text
froze every other thread for 8 s), so a server may tokenize on a worker thread and keep answering.
`max_bytes_per_token` derives, from `tokenizer.json`, how many bytes of text one token can stand for at most: a
prompt of B bytes then has at least ceil(B / bound) tokens, which lets a server refuse an over-long prompt
before paying for its tokenization.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
TokenStep = Callable[[int], "str | None"]  # one token in; its text once complete (None: held back)


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


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a ByteLevel (GPT-2) vocabulary stands for: printable bytes as themselves, the
    others shifted past U+00FF in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


def byte_level_pieces(tok: HFTokenizer, spec: dict[str, Any]) -> list[bytes] | None:
    """Each token id's bytes (b"" for special tokens), for a tokenizer whose decoder is ByteLevel alone (GPT-2,
    Llama 3, Qwen, SmolLM): decoding with special tokens skipped is then the UTF-8 of the concatenated pieces. None
    for any other decoder, and where a piece disagrees with the tokenizer's own decoding of that one token (all ids
    are checked, in one `decode_batch` call: ~0.1 s for 49k ids)."""
    if (spec.get("decoder") or {}).get("type") != "ByteLevel":
        return None
    alphabet = _byte_level_alphabet()
    specials = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    pieces: list[bytes] = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        token = None if i in specials else tok.id_to_token(i)
        if token is None:
            pieces.append(b"")
        elif all(c in alphabet for c in token):
            pieces.append(bytes(alphabet[c] for c in token))
        else:  # the decoder passes such a token (an added one) through as its UTF-8
            pieces.append(token.encode())
    texts = tok.decode_batch([[i] for i in range(len(pieces))], skip_special_tokens=True)
    if any(piece.decode("utf-8", "replace") != text for piece, text in zip(pieces, texts, strict=True)):
        return None
    return pieces


def whole_piece_texts(pieces: list[bytes]) -> list[str | None]:
    """Each piece's text where its bytes are whole UTF-8 characters by themselves (most tokens), else None."""
    texts: list[str | None] = []
    for piece in pieces:
        try:
            texts.append(piece.decode("utf-8") or None)
        except UnicodeDecodeError:
            texts.append(None)
    return texts


class ByteLevelDetokenizer:
    """Text deltas of a byte-level tokenizer's tokens (special tokens skipped): each token's bytes through an
    incremental UTF-8 decoder, which keeps back only the bytes of an unfinished character (`codecs`' decoder does
    the same, with a Python object of its own). A whole-character token with nothing pending is its precomputed text.

    No context and no bound are needed: UTF-8 resynchronises at every character, so the text of the tokens after a
    prompt whose last character is whole is the UTF-8 of their bytes alone; and what it keeps back is at most three
    bytes, so nothing is decoded again. `incremental_detokenizer` gives one to a request whose prompt allows it: one
    call per token in the engine's step, where `IncrementalDetokenizer` wraps this in a second."""

    __slots__ = ("_pending", "_pieces", "_texts")

    def __init__(self, pieces: list[bytes], texts: list[str | None]) -> None:
        self._pieces = pieces
        self._texts = texts
        self._pending = b""

    def add_token(self, token: int) -> str:
        """The text this token completes (may be empty)."""
        pending = self._pending
        if not pending:
            text = self._texts[token]
            if text is not None:
                return text
            data = self._pieces[token]
        else:
            data = pending + self._pieces[token]
        decoded, used = codecs.utf_8_decode(data, "replace", False)
        self._pending = data[used:]
        return decoded

    def step(self, token: int) -> str | None:
        """`add_token` as a `TokenStep` (None: held back), for `IncrementalDetokenizer`'s streams."""
        return self.add_token(token) or None

    def flush(self) -> str:
        """At the end of a request: the bytes still kept back (an unfinished character decodes as U+FFFD)."""
        text = codecs.utf_8_decode(self._pending, "replace", True)[0]
        self._pending = b""
        return text


class Tokenizer:
    """Encode/decode text and render chat prompts for one model folder."""

    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the builtin engine needs a fast-tokenizer tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        spec = json.loads(path.read_text())
        self.max_bytes_per_token = max_bytes_per_token(spec)
        self._pieces = byte_level_pieces(self._tok, spec)
        self._piece_texts = None if self._pieces is None else whole_piece_texts(self._pieces)
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

    def decode_stream(self, context_ids: Sequence[int], skip_special_tokens: bool = True) -> TokenStep:
        """One call per token, for `IncrementalDetokenizer`. A byte-level tokenizer (`byte_level_pieces`) needs no
        context: each token's bytes go through an incremental UTF-8 decoder, which holds back only the bytes of an
        unfinished character. Others go through `tokenizers`' DecodeStream (Rust, `context_ids` as left context),
        which follows the same prefix/read-offset rule as `IncrementalDetokenizer`'s own."""
        byte_level = self.byte_level_detokenizer() if skip_special_tokens else None
        if byte_level is not None:
            return byte_level.step
        stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        tok = self._tok
        return lambda token: stream.step(tok, token)

    def byte_level_detokenizer(self) -> ByteLevelDetokenizer | None:
        """A detokenizer over this tokenizer's table of pieces (special tokens skipped); None when it is not
        byte-level (`byte_level_pieces`)."""
        if self._pieces is None or self._piece_texts is None:
            return None
        return ByteLevelDetokenizer(self._pieces, self._piece_texts)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template: send a plain completion prompt instead")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{k: v for k, v in self._special_tokens.items() if v is not None},
        )


class Decoder(Protocol):
    """All that incremental detokenization needs of a tokenizer. One that also has `decode_stream(context_ids,
    skip_special_tokens)` (as `Tokenizer` has) lets `IncrementalDetokenizer` decode with one call per token."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer(Protocol):
    """One request's text deltas (`IncrementalDetokenizer`, or a `ByteLevelDetokenizer`)."""

    def add_token(self, token: int) -> str: ...

    def flush(self) -> str: ...


def _ends_whole(tokenizer: Decoder, ids: Sequence[int], skip_special_tokens: bool = True) -> bool:
    """Whether the text of `ids` ends in a whole character (a prompt's context that a stream may count as sent)."""
    return not tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT_CHAR)


def incremental_detokenizer(tokenizer: Decoder, prompt_token_ids: Sequence[int]) -> Detokenizer:
    """The detokenizer of one request: a byte-level tokenizer's own (`Tokenizer.byte_level_detokenizer`: one call
    a token) when the prompt's context ends in a whole character, else an `IncrementalDetokenizer` (which decides
    the same way whether to start on a stream). The text is the same either way."""
    make: Callable[[], Detokenizer | None] | None = getattr(tokenizer, "byte_level_detokenizer", None)
    byte_level = None if make is None else make()
    context = prompt_token_ids[-IncrementalDetokenizer.CONTEXT_TOKENS :]
    if byte_level is not None and _ends_whole(tokenizer, context):
        return byte_level
    return IncrementalDetokenizer(tokenizer, prompt_token_ids)


class IncrementalDetokenizer:
    """Text deltas for a growing token list (prefix/read offsets as in vLLM's `detokenize_incrementally`).

    `prefix_offset..read_offset` are tokens already turned into text, decoded again as left context so that
    tokenizers which change a token's text depending on its neighbours (leading spaces) decode consistently. A
    delta ending in U+FFFD (an incomplete UTF-8 sequence) is held back until more tokens complete it, but never
    more than `MAX_HELD_TOKENS`: a stream of bytes that never form a character (a model, or a request's
    `logit_bias`, choosing lone continuation bytes) would otherwise be decoded again whole at every step, O(n^2)
    over the output on the engine's thread (2,048 such tokens: 166 ms; with the bound: linear). Past the bound
    the held text is sent as it decodes, U+FFFD included, as `flush` would; no real character spans 64 tokens.

    With a tokenizer that has `decode_stream`, each token goes through that stream instead: one call where the
    Python rule makes two `decode` calls and slices strings (at 64 running requests, inside the engine's loop: 0.43
    -> 0.20 ms of its step). The offsets here follow each delta the stream sends. DecodeStream applies the Python
    rule itself; the byte table of a byte-level tokenizer sends a broken character's U+FFFD at once instead of
    holding it back (the same text). When the stream holds back `MAX_HELD_TOKENS` or fails (DecodeStream's prefix
    check is stricter), this detokenizer goes on with the Python rule; a prompt whose last tokens end in part of a
    character starts on the Python rule. The Python rule hands back to a new stream as soon as it has sent text that
    ends in a whole character (its context is then text the stream may count as sent), unless a stream failed: a
    random prompt ends in part of a character about one time in sixteen (SmolLM2's vocabulary), and its request
    would otherwise pay two `decode` calls a token for its whole life.
    """

    CONTEXT_TOKENS = 5
    MAX_HELD_TOKENS = 64
    __slots__ = ("_ids", "_make_stream", "_skip", "_step", "_tokenizer", "prefix_offset", "read_offset")

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-self.CONTEXT_TOKENS :])
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        # The stream starts from the context's text only when that text is whole: a context ending in part of a
        # character is text the stream has yet to send, where the Python rule counts it as sent.
        # None: no stream to hand to (the tokenizer has none, or one failed)
        self._make_stream: Callable[[Sequence[int], bool], TokenStep] | None = getattr(tokenizer, "decode_stream", None)
        self._step: TokenStep | None = None
        if self._make_stream is not None and _ends_whole(tokenizer, self._ids, skip_special_tokens):
            self._step = self._make_stream(self._ids, skip_special_tokens)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly completed text (may be empty)."""
        return "".join([self.add_token(token) for token in new_ids])

    def add_token(self, token: int) -> str:
        """Append one generated id; return the newly completed text (may be empty). The engine's call: one per
        token of every running request in every step, so it does no more than the token needs."""
        ids = self._ids
        ids.append(token)
        step = self._step
        if step is None:
            return self._advance()
        try:
            delta = step(token)
        except Exception:  # noqa: BLE001 - the stream's own prefix check: the Python rule takes over for good
            self._step = self._make_stream = None
            return self._advance()
        if delta is not None:
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return delta
        if len(ids) - self.read_offset >= self.MAX_HELD_TOKENS:
            self._step = None
            return self._advance()
        return ""

    def _advance(self) -> str:
        """The Python rule: the text the ids past `read_offset` complete, if any."""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self._ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and len(self._ids) - self.read_offset < self.MAX_HELD_TOKENS:
            return ""
        delta = full_text[len(prefix_text) :]
        held = len(self._ids) - self.read_offset
        if held < self.MAX_HELD_TOKENS:
            self.prefix_offset = self.read_offset
            if self._make_stream is not None and not full_text.endswith(REPLACEMENT_CHAR):
                # the text sent so far ends in a whole character: a stream from here sends what this rule would
                self._step = self._make_stream(self._ids[self.prefix_offset :], self._skip)
        else:
            self.prefix_offset = len(self._ids) - self.CONTEXT_TOKENS
        self.read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self._ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self._ids)
        return delta
