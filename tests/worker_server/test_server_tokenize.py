"""Big prompts cannot stall a worker: a prompt whose byte length proves it too long is refused untokenized (the
bound on bytes per token is derived from `tokenizer.json` and checked against real tokenizers), and tokenization
runs on a bounded thread pool, so `/health` and other requests answer while a prompt is being tokenized."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from worker.model.tokenizer import Tokenizer as ModelTokenizer
from worker.model.tokenizer import max_bytes_per_token
from worker.server.admission import check_prompt_bytes
from worker.server.errors import ApiError
from worker.server.fake_engine import FakeEngine

CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0 1 2 42 2024.",
    "def f(a):\n    return a + 1\n\n",
    "Ünïcödé: café, naïve, 東京, 😀 emoji.",
    "        indented\n            more\n",
] * 4


# ---- the pure check --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_bytes", "max_model_len", "bound", "refused"),
    [
        (80, 10, None, False),  # no bound known: nothing checked before tokenizing
        (10**9, 10, None, False),
        (36, 10, 4, False),  # 36 bytes may be 9 tokens: fits with one to spare
        (37, 10, 4, True),  # at least 10 tokens: no room for a completion
        (10, 10, 1, True),
        (9, 10, 1, False),
        (0, 1, 1, False),
        (1, 1, 81, True),  # a context of 1 holds no prompt at all
    ],
)
def test_check_prompt_bytes(num_bytes: int, max_model_len: int, bound: int | None, refused: bool) -> None:
    if not refused:
        check_prompt_bytes(num_bytes, max_model_len, bound)
        return
    with pytest.raises(ApiError) as info:
        check_prompt_bytes(num_bytes, max_model_len, bound)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert f"maximum context length is {max_model_len} tokens" in info.value.message


# ---- the bound, from tokenizer.json ----------------------------------------------------------------------------


def _byte_level_bpe(**post: Any) -> Tokenizer:
    tok = Tokenizer(models.BPE(**post.pop("model", {})))
    tok.pre_tokenizer = post.pop("pre", pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    for key, value in post.items():
        setattr(tok, key, value)
    return tok


def _spec(tok: Tokenizer) -> dict[str, Any]:
    return json.loads(tok.to_str())


def _longest_vocab_entry(tok: Tokenizer) -> int:
    return max(len(s) for s in tok.get_vocab())


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return _byte_level_bpe()


def test_byte_level_bound_is_the_longest_entry(tiny: Tokenizer) -> None:
    assert max_bytes_per_token(_spec(tiny)) == max(_longest_vocab_entry(tiny), len("<|im_start|>"))


def _with(spec: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(spec))
    for dotted, value in changes.items():
        node = out
        *path, last = dotted.split("__")
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value
    return out


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"normalizer": {"type": "NFKC"}}, "a normalizer may shrink text (NFKC composes)"),
        ({"normalizer": {"type": "Lowercase"}}, "lowercasing can shrink a character's bytes"),
        (
            {"truncation": {"max_length": 8, "strategy": "LongestFirst", "stride": 0, "direction": "Right"}},
            "truncation drops tokens",
        ),
        ({"pre_tokenizer": {"type": "Whitespace"}}, "drops whitespace"),
        (
            {
                "pre_tokenizer": {
                    "type": "Sequence",
                    "pretokenizers": [
                        {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False},
                        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
                    ],
                }
            },
            "a Removed split drops its matches",
        ),
        ({"model__type": "WordPiece"}, "one [UNK] may stand for a whole word"),
        ({"model__unk_token": "<unk>", "model__fuse_unk": True}, "fused unknowns have no length bound"),
        ({"added_tokens__0__lstrip": True}, "an lstrip token swallows any run of spaces"),
    ],
)
def test_no_bound_where_text_can_vanish(tiny: Tokenizer, change: dict[str, Any], why: str) -> None:
    assert max_bytes_per_token(_with(_spec(tiny), **change)) is None, why


def test_unknowns_not_fused_cost_at_most_4_bytes(tiny: Tokenizer) -> None:
    spec = _with(
        _spec(tiny),
        model__unk_token="<unk>",
        model__fuse_unk=False,
        model__vocab={"a": 0, "<unk>": 1},
        pre_tokenizer={"type": "Digits", "individual_digits": True},
        added_tokens=[],
    )
    assert max_bytes_per_token(spec) == len(b"<unk>")  # not byte-level: UTF-8 length of the entries


TEXTS = [
    "",
    "a",
    "hello world",
    " " * 500,
    "\n" + " " * 80,
    ("\n" + " " * 80) * 7,
    "\t" * 100 + "x",
    "0123456789" * 9,
    "<|im_start|>" * 5,
    "<|im_start|>user\nhi<|im_end|>",
    "東京" * 30,
    "😀" * 40,
    "é" * 33,
    "\u0301" * 20,
    "ab" * 200,
    "-" * 300,
    "=" * 257,
    "\x00\x01\x02\x7f",
    "A" * 1000,
]


def _assert_bound_holds(encode: Any, bound: int, text: str) -> None:
    ids = encode(text)
    assert len(ids) * bound >= len(text.encode()), (text[:40], len(ids), bound)


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_bound_holds(tiny: Tokenizer, text: str) -> None:
    bound = max_bytes_per_token(_spec(tiny))
    _assert_bound_holds(lambda t: tiny.encode(t).ids, bound, text)


PIECES = [" ", "\n", "\t", "a", "0", "東", "😀", "<|im_end|>", "<|im_start|>", "return", "    "]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.text(max_size=300) | st.lists(st.sampled_from(PIECES), max_size=200).map("".join))
def test_tiny_bound_holds_for_any_text(tiny: Tokenizer, text: str) -> None:
    _assert_bound_holds(lambda t: tiny.encode(t).ids, max_bytes_per_token(_spec(tiny)), text)


def test_model_tokenizer_exposes_the_bound(tmp_path: Path) -> None:
    tiny = _byte_level_bpe()
    tiny.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tiny.save(str(tmp_path / "tokenizer.json"))
    tok = ModelTokenizer(tmp_path)
    assert tok.max_bytes_per_token == max_bytes_per_token(_spec(tiny))
    assert tok.encode("hello world") == tiny.encode("hello world").ids  # encode_batch: same ids as encode


def test_normalizer_means_no_bound_in_the_model_tokenizer(tmp_path: Path) -> None:
    tok = _byte_level_bpe(normalizer=normalizers.NFKC())
    tok.save(str(tmp_path / "tokenizer.json"))
    assert ModelTokenizer(tmp_path).max_bytes_per_token is None


@pytest.mark.slow
def test_smollm2_bound_holds_and_is_tight() -> None:
    from worker.model.bundled import ensure_bundled

    tok = ModelTokenizer(ensure_bundled("smollm2-135m-instruct"))
    bound = tok.max_bytes_per_token
    assert bound == 81  # its longest entry: a newline and 80 spaces, one token
    for text in TEXTS:
        _assert_bound_holds(tok.encode, bound, text)
    worst = ("\n" + " " * 80) * 50
    assert len(tok.encode(worst)) * bound == len(worst.encode())  # tight: no smaller bound would be safe
    # A prompt one byte past the pre-check's limit has at least max_model_len tokens, as the check claims.
    max_model_len = 64
    over = ("\n" + " " * 80) * (max_model_len - 1) + "\n"
    assert len(over.encode()) == (max_model_len - 1) * bound + 1
    assert len(tok.encode(over)) >= max_model_len
    with pytest.raises(ApiError):
        check_prompt_bytes(len(over.encode()), max_model_len, bound)


# ---- on a live worker ------------------------------------------------------------------------------------------


class CountingEngine(FakeEngine):
    """A fake engine whose tokenize can be held: it records calls and, while `hold` is clear, blocks (bounded)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = 0
        self.inside = 0
        self.most_inside = 0
        self.entered = threading.Event()
        self.hold = threading.Event()
        self.hold.set()
        self._lock = threading.Lock()

    def tokenize(self, text: str) -> list[int]:
        with self._lock:
            self.calls += 1
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.entered.set()
        try:
            self.hold.wait(timeout=30)
            return super().tokenize(text)
        finally:
            with self._lock:
                self.inside -= 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x" * 16, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 8}]}),
    ],
)
def test_over_long_prompt_is_refused_untokenized(start_worker, path: str, body: dict[str, Any]) -> None:
    engine = CountingEngine(max_model_len=16)
    live = start_worker(engine, max_bytes_per_token=1)
    r = live.http().post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert engine.calls == 0
    ok = live.http().post("/v1/completions", json={"prompt": "x" * 15, "max_tokens": 1})
    assert ok.status_code == 200 and engine.calls == 1  # one byte less: tokenized and served


def test_health_and_other_requests_answer_while_a_prompt_is_tokenized(start_worker, wait) -> None:
    engine = CountingEngine()
    engine.hold.clear()  # the next tokenize blocks until the test lets it go
    live = start_worker(engine)
    results: list[httpx.Response] = []
    slow = threading.Thread(
        target=lambda: results.append(
            live.http().post("/v1/completions", json={"prompt": "a big prompt", "max_tokens": 2})
        ),
        daemon=True,
    )
    slow.start()
    try:
        assert engine.entered.wait(timeout=10), "the tokenization never started"
        with httpx.Client(base_url=live.base_url, timeout=5) as quick:  # the loop is free: these answer now
            assert quick.get("/health").status_code == 200
            assert quick.get("/ready").status_code == 200
            ids = quick.post("/v1/completions", json={"prompt": [72, 105], "max_tokens": 3})
            assert ids.status_code == 200 and ids.json()["choices"][0]["text"]
        assert engine.inside == 1 and not results  # the big one is still being tokenized
    finally:
        engine.hold.set()
    slow.join(timeout=15)
    assert results and results[0].status_code == 200


def test_tokenization_is_bounded_and_excess_gets_429(start_worker, wait) -> None:
    engine = CountingEngine()
    engine.hold.clear()
    live = start_worker(engine, tokenizer_threads=1, max_waiting=1, retry_after_s=3)
    results: list[httpx.Response] = []

    def post(prompt: str) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: results.append(
                live.http().post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            ),
            daemon=True,
        )
        thread.start()
        return thread

    threads = [post("first")]
    try:
        assert engine.entered.wait(timeout=10)
        threads.append(post("second"))
        wait(lambda: live.service.tokenizer_pool.waiting == 1, "the second request to wait for a tokenizer")
        busy = live.http().post("/v1/completions", json={"prompt": "third", "max_tokens": 2})
        assert busy.status_code == 429 and busy.headers["retry-after"] == "3"
        assert busy.json()["error"]["code"] == "tokenizer_busy"
        assert engine.most_inside == 1  # one thread: never two tokenizations at once
    finally:
        engine.hold.set()
    for thread in threads:
        thread.join(timeout=15)
    assert sorted(r.status_code for r in results) == [200, 200] and engine.most_inside == 1
