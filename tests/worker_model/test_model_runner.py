"""ModelRunner plumbing: KV-cache sizing, argument validation, contract attributes, step validation."""

from __future__ import annotations

import pytest
import torch
from worker.core.outputs import ScheduledSeq, SchedulerOutput
from worker.core.request import SamplingParams
from worker.model.config import ModelConfig
from worker.model.runner import ModelRunner, kv_block_bytes, plan_num_blocks

GREEDY = SamplingParams(temperature=0.0)


def test_kv_block_bytes_formula(tiny_dir):
    cfg = ModelConfig.from_dir(tiny_dir)  # 2 layers, 2 KV heads, head_dim 12
    assert kv_block_bytes(cfg, 16, torch.float32) == 2 * 2 * 16 * 2 * 12 * 4
    assert kv_block_bytes(cfg, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 12 * 2


@pytest.mark.parametrize(
    "block_bytes,max_len,num_blocks,kv_bytes,expected",
    [
        (1000, 64, 7, None, 7),  # explicit count wins
        (1000, 64, None, 10_500, 10),  # bytes // block bytes
        (1000, 64, None, None, 32),  # default: 8 sequences of max_model_len (4 blocks each) ...
        (10**8, 64, None, None, 5),  # ... capped by 512 MiB, but never below one full sequence (4 blocks)
        (10**9, 4096, None, None, 256),
    ],
)
def test_plan_num_blocks(block_bytes, max_len, num_blocks, kv_bytes, expected):
    assert plan_num_blocks(block_bytes, 16, max_len, num_blocks, kv_bytes) == expected


@pytest.mark.parametrize("num_blocks,kv_bytes,match", [(0, None, "at least 1"), (None, 10, "holds no KV block")])
def test_plan_num_blocks_errors(num_blocks, kv_bytes, match):
    with pytest.raises(ValueError, match=match):
        plan_num_blocks(1000, 16, 64, num_blocks, kv_bytes)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dtype": "float64"}, "dtype must be auto or one of"),
        ({"quantization": "int3"}, "quantization must be"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": 10**6}, "max_model_len"),
    ],
)
def test_bad_arguments(tiny_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelRunner(str(tiny_dir), enforce_eager=True, **kwargs)


def test_contract_attributes(tiny_dir):
    block = kv_block_bytes(ModelConfig.from_dir(tiny_dir), 16, torch.float32)
    r = ModelRunner(str(tiny_dir), kv_cache_bytes=10 * block + block // 2, max_model_len=100)
    assert (r.num_blocks, r.block_size, r.max_model_len) == (10, 16, 100)
    assert r.eos_token_id == r.tokenizer.eos_token_id == 2
    assert r.kv_cache.shape == (2, 2, 10, 16, 2, 12)
    assert r.kv_cache_bytes == 10 * r.block_bytes


def test_step_validation_fails_the_bad_sequence_alone(tiny_dir):
    r = ModelRunner(str(tiny_dir), num_blocks=4, block_size=4, max_model_len=12)
    good = ScheduledSeq("ok", [3, 4, 5], 0, [3], True, GREEDY)
    out = r.execute_model(
        SchedulerOutput([ScheduledSeq("a", list(range(3, 16)), 0, [0, 1, 2], True, GREEDY), good], 16)
    )
    assert "over max_model_len" in out.failed["a"]
    assert set(out.sampled_token_ids) == {"ok"}
    out = r.execute_model(SchedulerOutput([ScheduledSeq("a", [], 0, [0], True, GREEDY)], 0))
    assert "no tokens" in out.failed["a"]
    assert not out.sampled_token_ids
    with pytest.raises(ValueError, match="cannot hold"):
        r.execute_model(SchedulerOutput([ScheduledSeq("a", [5] * 6, 0, [0], True, GREEDY)], 6))
    assert r.execute_model(SchedulerOutput([], 0)).sampled_token_ids == {}


def test_only_sampling_rows_get_tokens_and_logprobs(tiny_dir):
    r = ModelRunner(str(tiny_dir), num_blocks=8, block_size=4)
    lp = SamplingParams(temperature=0.0, logprobs=True)
    out = r.execute_model(
        SchedulerOutput(
            [
                ScheduledSeq("chunk", [5, 6, 7, 8, 9], 0, [0, 1], False, GREEDY),  # mid-prefill: no sample
                ScheduledSeq("lp", [10, 11], 0, [2], True, lp),
                ScheduledSeq("plain", [12], 0, [3], True, GREEDY),
            ],
            8,
        )
    )
    assert set(out.sampled_token_ids) == {"lp", "plain"}
    assert set(out.logprobs) == {"lp"} and out.logprobs["lp"] <= 0.0


@pytest.fixture(scope="module")
def hd64_dir(tmp_path_factory):
    """Head dim 64 (what the AVX-512 decode passes take), GQA 4 over 2."""
    from worker.model.testing import make_tiny_llama

    return make_tiny_llama(
        tmp_path_factory.mktemp("hd64"), hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cache_lies_head_major_where_the_decode_kernel_reads_it(hd64_dir, monkeypatch, dtype):
    """Head-major where `head_major_cache` says so (the same [block, slot, head, dim] views, strided), token-major
    elsewhere; a batch of requests decodes to the same tokens either way (prompt chunks after cached tokens too)."""
    import worker.model.runner as runner_module
    from worker.engine.llm import LLM
    from worker.model.kernels import head_major_cache

    prompts = [[5 + i] * (3 + 9 * i) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run() -> tuple[bool, list[list[int]]]:
        llm = LLM(str(hd64_dir), dtype=dtype, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)  # chunked
        runner = llm.engine.runner
        k, v = runner.kv_caches[1]
        assert k.shape == v.shape == (64, 16, 2, 64)
        assert k.is_contiguous() == (not runner.head_major)
        return runner.head_major, [out.token_ids for out in llm.generate(prompts, params)]

    head_major, tokens = run()
    assert head_major == head_major_cache(getattr(torch, dtype), 64, 16)
    monkeypatch.setattr(runner_module, "head_major_cache", lambda *args: False)
    assert run() == (False, tokens)
