"""The scheduler driving the real torch ModelRunner (a tiny random Llama): greedy output must not depend on
batching, chunked prefill, prefix caching or preemption, and every KV block must come back.

Skips cleanly where the model part (worker.model.runner) is not installed. Marked slow: building the tiny model
and running it under four schedules takes some seconds on 2 cores.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("worker.model.runner")
testing = pytest.importorskip("worker.model.testing")

from worker import LLM, SamplingParams  # noqa: E402
from worker.core.config import EngineConfig  # noqa: E402
from worker.engine.async_engine import AsyncEngine  # noqa: E402

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. What is the capital of France?",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def add(a, b):",
    "Ünïcödé: café, naïve, 東京",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.slow

CONFIGS = {
    "batched": dict(max_num_seqs=8, max_num_batched_tokens=512, num_blocks=128),
    "chunked": dict(max_num_seqs=4, max_num_batched_tokens=8, num_blocks=128),
    "tight-memory": dict(max_num_seqs=6, max_num_batched_tokens=64, num_blocks=14),  # longest request: 49 tokens
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(testing.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def alone(tiny_model) -> list:
    """The baseline: one request at a time, no prefix cache, whole prompts in one step."""
    llm = LLM(
        tiny_model, max_num_seqs=1, max_num_batched_tokens=512, enable_prefix_caching=False, block_size=4, num_blocks=64
    )
    return [llm.generate([p], GREEDY)[0] for p in PROMPTS]


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_output_is_independent_of_scheduling(name, tiny_model, alone, kit) -> None:
    llm = LLM(tiny_model, block_size=4, **CONFIGS[name])
    for _ in range(2):  # the second round is served partly from the prefix cache
        outs = llm.generate(PROMPTS, GREEDY)
        for out, ref in zip(outs, alone, strict=True):
            assert out.token_ids == ref.token_ids, out.prompt_token_ids
            assert out.text == ref.text
        kit.assert_pool_empty(llm.engine.scheduler)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits_total > 0
    if name == "tight-memory":
        assert stats.num_preemptions_total > 0


async def test_async_engine_streams_the_same_text(tiny_model, alone) -> None:
    engine = AsyncEngine(EngineConfig(model=tiny_model, block_size=4, num_blocks=64))
    await engine.start()
    try:
        chat = engine.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
        assert chat.endswith("assistant\n")
        outs = [o async for o in engine.generate(PROMPTS[0], GREEDY, "r0")]
        assert [t for o in outs for t in o.new_token_ids] == alone[0].token_ids
        assert "".join(o.new_text for o in outs) == alone[0].text
        assert engine.stats().kv_cache_usage == 0.0
    finally:
        await engine.shutdown()
