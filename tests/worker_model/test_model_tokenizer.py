"""Tokenizer from a model folder: encode/decode, EOS, chat template, incremental detokenization."""

from __future__ import annotations

import json

import pytest
from worker.model.tokenizer import (
    REPLACEMENT_CHAR,
    ByteLevelDetokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    incremental_detokenizer,
)

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
    assert "".join(deltas) == text
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
    assert tail and set(tail) == {REPLACEMENT_CHAR}


class _PythonOnly:
    """A tokenizer without `decode_stream`: IncrementalDetokenizer then runs its Python rule."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _deltas(decoder, prompt: list[int], ids: list[int], per_call: int = 1) -> list[str]:
    det = IncrementalDetokenizer(decoder, prompt)
    deltas = [det.add_tokens(ids[i : i + per_call]) for i in range(0, len(ids), per_call)]
    deltas.append(det.flush())
    return deltas


@pytest.fixture(scope="module")
def sentencepiece_tok(tmp_path_factory):
    """A Llama-2-style tokenizer (Metaspace pieces, byte fallback): not byte-level, so it decodes through
    `tokenizers`' DecodeStream."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    chars = "\u2581abcdefghijklmnopqrstuvwxyzHW,.:()+=\u00e9\u00ef"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {c: len(vocab) + i for i, c in enumerate(chars)}
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("\u2581", "a"), ("l", "l"), ("e", "ll")]
    vocab |= {x + y: len(vocab) + i for i, (x, y) in enumerate(merges)}
    hf = HF(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    hf.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    folder = tmp_path_factory.mktemp("sp")
    hf.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def test_byte_level_tokenizers_decode_from_a_table_of_pieces(tok, sentencepiece_tok):
    assert tok._pieces is not None and len(tok._pieces) == tok.vocab_size
    assert tok._pieces[2] == b""  # a special token, skipped
    assert sentencepiece_tok._pieces is None  # its decoder is not ByteLevel: DecodeStream


@pytest.mark.parametrize("text", TEXTS[:4] + ["😀😀 東京タワー ok", "<|im_end|>x"])
def test_the_fast_paths_give_the_deltas_of_the_python_rule(tok, sentencepiece_tok, text):
    for t in (tok, sentencepiece_tok):
        prompt = t.encode("Prompt: ")
        ids = t.encode(text, add_special_tokens=False)
        assert IncrementalDetokenizer(t, prompt)._step is not None  # the fast path is the one under test
        assert _deltas(t, prompt, ids) == _deltas(_PythonOnly(t), prompt, ids)


@pytest.mark.parametrize("seed", range(8))
def test_the_fast_paths_on_any_token_sequence(tok, sentencepiece_tok, seed):
    # random ids over the whole vocabulary: byte pieces that split characters or never form one, specials,
    # prompts that end inside a character
    import random

    rng = random.Random(seed)
    for t in (tok, sentencepiece_tok):
        ids = [rng.randrange(t.vocab_size) for _ in range(200)]
        prompt = [rng.randrange(t.vocab_size) for _ in range(7)]
        python = _deltas(_PythonOnly(t), prompt, ids)
        if t is sentencepiece_tok:  # DecodeStream follows the Python rule: the same delta at every step
            assert _deltas(t, prompt, ids) == python
            continue
        # the byte table sends a broken character's U+FFFD at once where the Python rule holds it back; the
        # text is the same, whether the output processor feeds one token at a time or several
        for per_call in (1, 3):
            assert "".join(_deltas(t, prompt, ids, per_call)) == "".join(python)


@pytest.mark.parametrize("seed", range(4))
def test_the_byte_level_step_sends_what_an_incremental_utf8_decoder_sends(tok, seed):
    # token by token, the same deltas as `codecs`' decoder over the same bytes (the step skips it for whole pieces)
    import codecs
    import random

    rng = random.Random(seed)
    partial = [i for i, piece in enumerate(tok._pieces) if tok._piece_texts[i] is None and piece]
    assert partial  # pieces that are parts of characters (or never form one) are in the mix
    ids = [rng.choice(partial) if rng.random() < 0.4 else rng.randrange(tok.vocab_size) for _ in range(400)]
    step = tok.decode_stream([])
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    assert [step(i) for i in ids] == [utf8.decode(tok._pieces[i]) or None for i in ids]


def test_the_fast_path_keeps_the_held_back_bound(sentencepiece_tok):
    # a byte that never completes a character, repeated past MAX_HELD_TOKENS: DecodeStream would hold it forever;
    # the detokenizer sends it at the bound, as the Python rule does, and goes on in Python
    t = sentencepiece_tok
    lone = t._tok.token_to_id("<0x80>")
    n = IncrementalDetokenizer.MAX_HELD_TOKENS * 2 + 3
    fast = _deltas(t, [], [lone] * n)
    assert fast == _deltas(_PythonOnly(t), [], [lone] * n)
    assert fast[IncrementalDetokenizer.MAX_HELD_TOKENS - 1] != ""  # sent at the bound, not held to the end


def test_a_byte_level_stream_holds_back_only_an_unfinished_character(tok):
    lone = next(i for i, piece in enumerate(tok._pieces) if piece == b"\x80")
    deltas = _deltas(tok, [], [lone] * 5)
    assert deltas == [REPLACEMENT_CHAR] * 5 + [""]  # an invalid byte is sent at once, never held


def test_a_failing_stream_hands_over_to_the_python_rule(tok):
    class Failing(_PythonOnly):
        def decode_stream(self, context_ids, skip_special_tokens=True):
            def step(token):
                raise RuntimeError("InvalidPrefix")

            return step

    ids = tok.encode("café naïve 東京 😀 and more", add_special_tokens=False)
    assert _deltas(Failing(tok), [], ids) == _deltas(_PythonOnly(tok), [], ids)


def test_a_prompt_ending_inside_a_character_goes_back_to_the_fast_path(tok, sentencepiece_tok):
    # the Python rule runs while the prompt's broken character is pending; once it has sent text ending in a
    # whole character, a stream takes over, and the deltas stay the Python rule's
    smile = tok.encode("😀", add_special_tokens=False)
    cases = [(tok, tok.encode("Prompt: ", add_special_tokens=False) + smile[:-1])]
    lone = sentencepiece_tok._tok.token_to_id("<0xE6>")  # the first byte of a 3-byte character
    cases.append((sentencepiece_tok, sentencepiece_tok.encode("Prompt", add_special_tokens=False) + [lone]))
    for t, prompt in cases:
        ids = t.encode("hello there, café 東京 and more", add_special_tokens=False)
        det = IncrementalDetokenizer(t, prompt)
        assert det._step is None  # the prompt's last character is unfinished: the Python rule first
        deltas = [det.add_token(i) for i in ids]
        assert det._step is not None
        assert deltas + [det.flush()] == _deltas(_PythonOnly(t), prompt, ids)


def test_a_stream_that_failed_is_not_tried_again(tok):
    made = []

    class Failing(_PythonOnly):
        def decode_stream(self, context_ids, skip_special_tokens=True):
            def step(token):
                raise RuntimeError("InvalidPrefix")

            made.append(step)
            return step

    ids = tok.encode("plain ascii text, word after word", add_special_tokens=False)
    assert _deltas(Failing(tok), [], ids) == _deltas(_PythonOnly(tok), [], ids)
    assert len(made) == 1


@pytest.mark.parametrize("seed", range(6))
def test_a_request_of_a_byte_level_tokenizer_gets_its_one_call_detokenizer(tok, seed):
    # random ids over the whole vocabulary (byte pieces that split characters or never form one, specials) after a
    # prompt that ends in a whole character: one call a token, and the text of the Python rule
    import random

    rng = random.Random(seed)
    prompt = tok.encode("Prompt: ")
    ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
    det = incremental_detokenizer(tok, prompt)
    assert isinstance(det, ByteLevelDetokenizer)
    text = "".join(det.add_token(i) for i in ids) + det.flush()
    assert text == "".join(_deltas(_PythonOnly(tok), prompt, ids))
    assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert det.flush() == ""


def test_the_other_requests_get_the_incremental_detokenizer(tok, sentencepiece_tok):
    smile = tok.encode("😀", add_special_tokens=False)
    broken = tok.encode("Prompt: ", add_special_tokens=False) + smile[:-1]  # ends inside a character
    assert isinstance(incremental_detokenizer(tok, broken), IncrementalDetokenizer)
    for t in (sentencepiece_tok, _PythonOnly(tok)):  # not byte-level; no table at all
        assert isinstance(
            incremental_detokenizer(t, t.encode("Prompt") if t is sentencepiece_tok else [5]), IncrementalDetokenizer
        )


def test_a_byte_level_detokenizer_keeps_back_an_unfinished_character_until_the_end(tok):
    smile = tok.encode("😀", add_special_tokens=False)
    assert len(smile) > 1  # a character in several byte pieces
    det = incremental_detokenizer(tok, tok.encode("Prompt: "))
    assert [det.add_token(i) for i in smile[:-1]] == [""] * (len(smile) - 1)
    assert det.flush() == REPLACEMENT_CHAR  # sent whole at the end, as the Python rule's flush does
    assert [det.add_token(i) for i in smile] == [""] * (len(smile) - 1) + ["😀"]
