"""Tokenizer from a model folder: encode/decode, EOS, chat template, incremental detokenization."""

from __future__ import annotations

import json

import pytest
from worker.model.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer

TEXTS = ["Hello, world!", "café naïve 東京 😀", "def add(a, b):\n    return a + b", "  leading spaces", ""]


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_and_eos(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.eos_token_id == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi?<|im_end|>\n")


def test_template_helpers_and_add_bos(tmp_path, tiny_dir):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m | tojson }}{% endfor %}"
    )
    cfg = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "chat_template": template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == '<|im_start|>{"role": "user", "content": "é"}'
    with pytest.raises(Exception, match="no tools"):
        t.apply_chat_template([{"role": "tool", "content": "x"}])
    assert t.encode("hi")[0] == 1
    assert t.encode("hi", add_special_tokens=False)[0] != 1


def test_missing_template_is_a_clear_error(tmp_path, tiny_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize("text", TEXTS[:4] + ["😀😀 東京タワー ok"])
def test_incremental_detokenizer_never_splits_characters(tok, text):
    prompt = tok.encode("Prompt: ")
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt)
    deltas = [det.add_tokens([i]) for i in ids]
    deltas.append(det.flush())
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == det.text == text
    multibyte = [c for c in text if len(c.encode()) > 1]
    if multibyte:  # some single tokens carry partial characters: the detokenizer must have held them back
        assert len(ids) > len([d for d in deltas if d])


def test_incremental_detokenizer_batches_and_skips_specials(tok):
    det = IncrementalDetokenizer(tok)
    ids = tok.encode("ab<|im_end|>cd")
    out = det.add_tokens(ids[:2]) + det.add_tokens(ids[2:]) + det.flush()
    assert out == "abcd"


def test_flush_emits_incomplete_tail(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level pieces
    det = IncrementalDetokenizer(tok)
    assert det.add_tokens(ids[:-1]) == ""
    tail = det.flush()
    assert tail and set(tail) == {REPLACEMENT_CHAR} and det.text == tail
