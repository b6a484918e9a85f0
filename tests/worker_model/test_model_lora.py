"""LoRA adapters in our engine on the tiny Llama: greedy output of a batch that mixes two adapters and the base
equals transformers with each adapter merged into the weights (W + scale * B @ A); the runner loads adapters into
slots as the scheduler hands them out (LRU eviction, reload); a bad adapter is refused with a clear error and the
base keeps serving; KV computed under one adapter is never reused for another."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from worker.core.request import SamplingParams
from worker.engine.llm import LLM
from worker.model.config import ModelConfig
from worker.model.lora import LoraError, load_lora, segments_of
from worker.model.testing import make_random_lora, merge_lora_into

N_OUT = 10
GREEDY = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def hf_greedy(model, prompt: list[int], n: int = N_OUT) -> list[int]:
    out, past, x = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            o = model(x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            out.append(int(o.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory):
    """Two adapters: one on every projection (rank 8), one on q/v/down only with rsLoRA (rank 4)."""
    root = tmp_path_factory.mktemp("loras")
    a = make_random_lora(root / "a", tiny_dir, rank=8, alpha=16, seed=1)
    b = make_random_lora(
        root / "b", tiny_dir, rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), use_rslora=True, seed=2
    )
    return {"a": (root / "a", a, 16 / 8), "b": (root / "b", b, 8 / math.sqrt(4))}


@pytest.fixture(scope="module")
def references(tiny_dir, adapters):
    """name -> transformers model with that adapter merged (None: the base)."""
    from transformers import LlamaForCausalLM

    def load_hf_fn(path):
        return LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    models = {None: load_hf_fn(tiny_dir)}
    for name, (_, tensors, scale) in adapters.items():
        model = load_hf_fn(tiny_dir)
        with torch.no_grad():
            merge_lora_into(model.state_dict(), tensors, scale)
        models[name] = model
    return models


def make_llm(tiny_dir, **kwargs) -> LLM:
    args = {"enable_lora": True, "max_loras": 2, "block_size": 4, "num_blocks": 256} | kwargs
    return LLM(str(tiny_dir), **args)


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 16, "max_num_seqs": 8},
        {"enable_prefix_caching": False, "enforce_eager": True},
        {"speculative": {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 16}},
    ],
    ids=["one-step-prefill", "chunked", "eager-no-cache", "speculative"],
)
def test_mixed_batch_equals_merged_transformers(tiny_dir, adapters, references, engine_args):
    llm = make_llm(tiny_dir, **engine_args)
    for name, (path, _, _) in adapters.items():
        llm.add_lora(name, str(path))
    ps = prompts(9, llm.engine.runner.vocab_size)
    if "speculative" in engine_args:  # repeated prompts give the n-gram proposer drafts to verify
        ps = [p[:6] * 3 for p in ps]
    names = [None, "a", "b"] * 3
    outs = llm.generate(ps, GREEDY, lora=names)
    expected = [hf_greedy(references[name], p) for p, name in zip(ps, names, strict=True)]
    assert [o.token_ids for o in outs] == expected
    spec = llm.engine.stats().spec_decode
    assert spec is None or spec.num_draft_tokens > 0  # drafts of adapter requests were verified
    # the adapters change the answers (else this test would prove nothing)
    assert len({tuple(hf_greedy(references[n], ps[0])) for n in (None, "a", "b")}) == 3


@pytest.mark.parametrize(("dtype", "quantization"), [("bfloat16", None), ("float32", "fp8"), ("bfloat16", "int8")])
def test_adapters_on_bf16_and_quantized_bases(tiny_dir, adapters, dtype, quantization):
    """Adapter weights follow the base's dtype (the activation dtype for weight-only quantization): a mixed batch
    runs, and the adapters change the answers."""
    llm = make_llm(tiny_dir, dtype=dtype, quantization=quantization)
    for name, (path, _, _) in adapters.items():
        llm.add_lora(name, str(path))
    store = llm.engine.runner.lora_store
    assert store is not None and store.a[0]["qkv"].dtype == getattr(torch, dtype)
    p = prompts(1, llm.engine.runner.vocab_size, seed=4)[0]
    outs = llm.generate([p, p, p], GREEDY, lora=[None, "a", "b"])
    assert all(o.finish_reason is not None and o.finish_reason.value == "length" for o in outs)
    assert outs[1].token_ids != outs[0].token_ids and outs[2].token_ids != outs[0].token_ids


def test_one_slot_evicts_and_reloads_and_stays_exact(tiny_dir, adapters, references):
    llm = make_llm(tiny_dir, max_loras=1)
    for name, (path, _, _) in adapters.items():
        llm.add_lora(name, str(path))
    ps = prompts(6, llm.engine.runner.vocab_size, seed=3)
    names = ["a", "b", None, "b", "a", "a"]
    outs = llm.generate(ps, GREEDY, lora=names)
    assert [o.token_ids for o in outs] == [hf_greedy(references[n], p) for p, n in zip(ps, names, strict=True)]
    stats = llm.engine.stats().lora
    assert stats is not None and stats.max_loras == 1
    assert stats.loads_total >= 2 and stats.evictions_total >= 1
    again = llm.generate(ps[:2], GREEDY, lora=["a", "b"])  # b is resident now: a is loaded again
    assert [o.token_ids for o in again] == [hf_greedy(references[n], p) for p, n in zip(ps[:2], ["a", "b"])]


def test_prefix_cache_is_not_shared_across_adapters(tiny_dir, adapters, references):
    llm = make_llm(tiny_dir)
    llm.add_lora("a", str(adapters["a"][0]))
    prompt = prompts(1, llm.engine.runner.vocab_size, seed=5)[0] * 3  # > several blocks of 4
    first = llm.generate([prompt], GREEDY, lora="a")[0]
    same = llm.generate([prompt], GREEDY, lora="a")[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert same.num_cached_tokens > 0  # the adapter's own prefix is reused
    assert base.num_cached_tokens == 0  # but never for the base
    assert first.token_ids == same.token_ids == hf_greedy(references["a"], prompt)
    assert base.token_ids == hf_greedy(references[None], prompt)


def test_segments_merge_touching_runs_of_one_slot():
    cases = [
        ([], []),
        ([(0, 1, -1), (1, 2, 0)], [(1, 2, 0)]),
        ([(0, 1, 0), (1, 2, 0), (2, 5, 1), (5, 6, 0)], [(0, 2, 0), (2, 5, 1), (5, 6, 0)]),
        ([(0, 1, 0), (2, 3, 0)], [(0, 1, 0), (2, 3, 0)]),  # not touching: a base row between
    ]
    for runs, expected in cases:
        assert segments_of(runs) == expected


@pytest.mark.parametrize(
    ("runs", "num_decode", "batched"),
    [
        # decodes of slots 0 and 2 batched (slot 1 empty: padding), the chunk of slot 0 run by run: all at once
        # would pad 8 rows to 21
        ([(1, 3, 0), (3, 4, 2), (4, 9, 0)], 4, True),
        ([(0, 2, 2), (2, 3, 0)], 3, True),
        ([(0, 2, 2), (5, 9, 2)], 2, True),  # two runs of one adapter: one gathered pass, no padding
        ([(2, 6, 0), (6, 9, 2)], 0, True),  # two prefill chunks: 7 rows padded to 12
        ([(0, 1, 0), (1, 9, 2)], 1, False),  # 9 rows would pad to 24, one adapter among the decodes: run by run
        ([(2, 9, 2)], 0, False),  # one run
    ],
)
def test_batched_and_run_by_run_deltas_equal_a_per_row_reference(tiny_dir, adapters, runs, num_decode, batched):
    from worker.model.lora import LoraStore, plan_batch

    cfg = ModelConfig.from_dir(tiny_dir)
    store = LoraStore(cfg, 3, 16, torch.float32, "cpu")
    loaded = {0: load_lora(adapters["a"][0], cfg, max_rank=16), 2: load_lora(adapters["b"][0], cfg, max_rank=16)}
    for slot, lora in loaded.items():
        store.put(slot, lora)
    batch = plan_batch(store, runs, num_decode, torch.float32, "cpu")
    assert (batch.gather is not None) == batched
    for group, x_size, out_size in [
        ("qkv", cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size),
        ("down", cfg.intermediate_size, cfg.hidden_size),
    ]:
        x = torch.randn(9, x_size, generator=torch.Generator().manual_seed(0))
        base = torch.randn(9, out_size, generator=torch.Generator().manual_seed(1))
        out = base.clone()
        batch.apply(1, group, x, out)
        expected = base.clone()
        for start, end, slot in runs:
            delta = loaded[slot].layers[1][group]
            for row in range(start, end):
                expected[row] += x[row] @ delta.a_t @ delta.b_t
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ---- bad adapters ------------------------------------------------------------------------------------------------


def _copy_adapter(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def _missing_weights(d: Path) -> None:
    (d / "adapter_model.safetensors").unlink()


def _missing_config(d: Path) -> None:
    (d / "adapter_config.json").unlink()


def _rank_too_large(d: Path) -> None:
    _edit_config(d, r=64)


def _shape_mismatch(d: Path) -> None:
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _edit_tensors(d, lambda t: t.__setitem__(key, torch.zeros(7, 8)))


def _unknown_target(d: Path) -> None:
    _edit_config(d, target_modules=["q_proj", "lm_head"])


def _untargetable_tensor(d: Path) -> None:
    _edit_tensors(d, lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(8, 72)))


def _missing_half(d: Path) -> None:
    _edit_tensors(d, lambda t: t.pop("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"))


def _layer_out_of_range(d: Path) -> None:
    key = "base_model.model.model.layers.{}.mlp.down_proj.lora_{}.weight"
    _edit_tensors(
        d,
        lambda t: t.update({key.format(9, h): t[key.format(0, h)].clone() for h in "AB"}),
    )


def _dora(d: Path) -> None:
    _edit_config(d, use_dora=True)


BAD_ADAPTERS = [
    (_missing_weights, "has no adapter_model.safetensors"),
    (_missing_config, "has no adapter_config.json"),
    (_rank_too_large, "exceeds max_lora_rank=16: start the worker with --max-lora-rank 64"),
    (_shape_mismatch, "do not fit the base model"),
    (_unknown_target, "target_modules names ['lm_head']"),
    (_untargetable_tensor, "is not the lora_A/lora_B weight"),
    (_missing_half, "layer 1 up_proj has no lora_B.weight"),
    (_layer_out_of_range, "layer 9 does not exist"),
    (_dora, "use_dora is true"),
]


@pytest.mark.parametrize(("breaker", "message"), BAD_ADAPTERS, ids=[b.__name__.strip("_") for b, _ in BAD_ADAPTERS])
def test_bad_adapter_is_refused_with_a_clear_error(tiny_dir, adapters, tmp_path, breaker, message):
    bad = _copy_adapter(adapters["a"][0], tmp_path / "bad")
    breaker(bad)
    cfg = ModelConfig.from_dir(tiny_dir)
    with pytest.raises(LoraError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_lora(bad, cfg, max_rank=16)


def test_bad_adapter_leaves_the_base_serving(tiny_dir, adapters, references, tmp_path):
    llm = make_llm(tiny_dir)
    bad = _copy_adapter(adapters["a"][0], tmp_path / "bad")
    _shape_mismatch(bad)
    with pytest.raises(ValueError, match="do not fit the base model"):
        llm.add_lora("bad", str(bad))
    with pytest.raises(ValueError, match="no LoRA adapter named 'bad'"):
        llm.generate([[5, 6, 7]], GREEDY, lora="bad")
    p = prompts(1, llm.engine.runner.vocab_size, seed=9)[0]
    assert llm.generate([p], GREEDY)[0].token_ids == hf_greedy(references[None], p)


def test_adapter_files_gone_fail_only_their_requests(tiny_dir, adapters, references, tmp_path):
    """Registered, then its files vanish before its first load into a slot: its request ends with an error,
    the base request beside it is served."""
    llm = make_llm(tiny_dir)
    folder = _copy_adapter(adapters["a"][0], tmp_path / "gone")
    llm.add_lora("gone", str(folder))
    _missing_weights(folder)
    p = prompts(1, llm.engine.runner.vocab_size, seed=11)[0]
    outs = llm.generate([p, p], GREEDY, lora=["gone", None])
    assert outs[0].finish_reason is not None and outs[0].finish_reason.value == "error"
    assert "has no adapter_model.safetensors" in (outs[0].error or "")
    assert outs[1].token_ids == hf_greedy(references[None], p)


def test_lora_off_refuses_adapters(tiny_dir, adapters):
    llm = LLM(str(tiny_dir), block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.add_lora("a", str(adapters["a"][0]))
