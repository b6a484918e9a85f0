"""AsyncEngine: per-request DELTA streams, abort on cancellation, pause/resume, admission errors, failure."""

from __future__ import annotations

import asyncio
import threading

import pytest
from worker import LLM
from worker.core.config import EngineConfig
from worker.core.request import FinishReason, SamplingParams
from worker.core.scheduler import QueueFullError
from worker.engine.async_engine import AsyncEngine, EngineDeadError, merge_outputs
from worker.engine.protocol import EngineClient, RequestOutput
from worker.engine.toy import ToyRunner

LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


class GatedRunner(ToyRunner):
    """A toy runner whose steps run only when the test allows them (`allow(n)`), or freely after `open()`."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._gate = threading.Semaphore(0)
        self._open = threading.Event()

    def allow(self, n: int = 1) -> None:
        self._gate.release(n)

    def open(self) -> None:
        self._open.set()
        self._gate.release(1)

    def execute_model(self, scheduler_output):
        for _ in range(200):  # bounded: a test that forgets to open the gate fails instead of hanging
            if self._open.is_set() or self._gate.acquire(timeout=0.05):
                return super().execute_model(scheduler_output)
        raise AssertionError("the test never let this step run")


async def _until(cond, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def _engine(runner: ToyRunner | None = None, **cfg) -> AsyncEngine:
    cfg.setdefault("block_size", 4)
    runner = runner or ToyRunner(num_blocks=128, block_size=cfg["block_size"])
    engine = AsyncEngine(EngineConfig(**cfg), runner=runner)
    await engine.start()
    return engine


async def _collect(engine: AsyncEngine, prompt, params, rid: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid)]


async def test_streams_add_up_to_the_offline_result() -> None:
    engine = await _engine(max_num_seqs=3, max_num_batched_tokens=16)
    assert isinstance(engine, EngineClient)
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=("zz",))
    prompts = ["hello", "héllo wörld 東京", [1, 2, 3, 4, 5, 6, 7, 8, 9], "a longer prompt with many words"]
    streams = await asyncio.gather(*(_collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts)))
    offline = LLM(runner=ToyRunner(num_blocks=128, block_size=4), block_size=4).generate(prompts, params)
    for outs, expected in zip(streams, offline, strict=True):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert [t for o in outs for t in o.new_token_ids] == expected.token_ids
        assert "".join(o.new_text for o in outs) == expected.text
        assert outs[-1].finish_reason is expected.finish_reason
        assert outs[-1].num_output_tokens == len(expected.token_ids)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    await engine.shutdown()


async def test_leaving_the_stream_early_aborts_and_frees_blocks() -> None:
    runner = GatedRunner(num_blocks=64, block_size=4)
    engine = await _engine(runner)
    runner.allow(3)
    stream = engine.generate("some prompt", LONG, "r1")
    async for out in stream:
        assert not out.finished
        break  # client went away
    await stream.aclose()  # what the server's handler does (garbage collection would do it later)
    runner.open()
    await _until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0, "abort")
    assert runner.num_steps < 20  # ended by the abort, not by running to max_tokens
    await engine.shutdown()


async def test_cancelling_the_consumer_task_aborts_the_request() -> None:
    runner = GatedRunner(num_blocks=64, block_size=4)
    engine = await _engine(runner)
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("some prompt", LONG, "r1"):
            first.set()

    task = asyncio.create_task(consume())
    runner.allow(2)
    await asyncio.wait_for(first.wait(), 5)
    assert engine.stats().num_running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    runner.open()
    await _until(lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0, "abort")
    assert runner.num_steps < 20  # ended by the abort, not by running to max_tokens
    await engine.shutdown()


async def test_explicit_abort_ends_the_stream_with_reason_abort() -> None:
    runner = GatedRunner(num_blocks=64, block_size=4)
    engine = await _engine(runner)
    outs = []

    async def consume() -> None:
        async for out in engine.generate("prompt", LONG, "r1"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("r1")
            runner.allow(1)

    runner.allow(1)
    await asyncio.wait_for(consume(), 5)
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.ABORT
    assert engine.stats().kv_cache_usage == 0.0
    await engine.abort("unknown")  # ignored
    runner.open()
    await engine.shutdown()


async def test_pause_admits_nothing_new_but_finishes_what_runs() -> None:
    engine = await _engine(GatedRunner(num_blocks=64, block_size=4))
    runner = engine._runner
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    running = asyncio.create_task(_collect(engine, "first", short, "first"))
    runner.allow(1)
    await _until(lambda: engine.stats().num_running == 1, "first admitted")
    await engine.pause()
    late = asyncio.create_task(_collect(engine, "late", short, "late"))
    runner.allow(10)
    outs = await asyncio.wait_for(running, 5)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    await _until(lambda: engine.stats().num_waiting == 1, "late queued")
    assert not late.done() and engine.stats().extra["paused"]
    await engine.resume()
    runner.open()
    late_outs = await asyncio.wait_for(late, 5)
    assert late_outs[-1].num_output_tokens == 3
    await engine.shutdown()


async def test_admission_errors_are_raised_before_any_output() -> None:
    engine = await _engine(ToyRunner(num_blocks=4, block_size=4), max_waiting=1)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        await _collect(engine, "x" * 40, LONG, "long")
    with pytest.raises(ValueError, match="prompt is empty"):
        await _collect(engine, [], LONG, "empty")
    await engine.pause()
    waiting = engine.generate("x", LONG, "w1")
    first = asyncio.create_task(waiting.__anext__())
    await _until(lambda: engine.stats().num_waiting == 1, "queued")
    with pytest.raises(ValueError, match="already in use"):
        await _collect(engine, "x", LONG, "w1")
    with pytest.raises(QueueFullError):
        await _collect(engine, "x", LONG, "w2")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await _until(lambda: engine.stats().num_waiting == 0, "abort of the waiting request")
    await engine.shutdown()


async def test_a_failing_model_fails_every_stream_and_later_requests() -> None:
    class Exploding(ToyRunner):
        def execute_model(self, scheduler_output):
            if self.num_steps >= 2:
                raise RuntimeError("model exploded")
            return super().execute_model(scheduler_output)

    engine = await _engine(Exploding(num_blocks=64, block_size=4))
    with pytest.raises(EngineDeadError, match="model exploded"):
        await _collect(engine, "prompt", LONG, "r1")
    with pytest.raises(EngineDeadError):
        await _collect(engine, "prompt", LONG, "r2")
    await engine.shutdown()


async def test_shutdown_ends_streams_in_flight_with_abort() -> None:
    runner = GatedRunner(num_blocks=64, block_size=4)
    engine = await _engine(runner)
    task = asyncio.create_task(_collect(engine, "prompt", LONG, "r1"))
    runner.allow(2)
    await _until(lambda: engine.stats().num_running == 1, "running")
    runner.open()
    await engine.shutdown()
    outs = await asyncio.wait_for(task, 5)
    assert outs[-1].finish_reason is FinishReason.ABORT
    with pytest.raises(EngineDeadError, match="shut down"):
        await _collect(engine, "prompt", LONG, "r2")


async def test_tokenizer_and_chat_template_pass_through() -> None:
    engine = AsyncEngine(EngineConfig(block_size=4, served_model_name="toy"), runner=ToyRunner(block_size=4))
    with pytest.raises(RuntimeError, match="not started"):
        engine.tokenize("x")
    await engine.start()
    await engine.start()  # idempotent
    # the effective limit: 256 blocks of 4 tokens, below the runner's 4096
    assert engine.model_name == "toy" and engine.max_model_len == 1024
    assert engine.tokenize("hé") == [104, 195, 169]
    assert engine.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>hi\n<|assistant|>"
    await engine.shutdown()


def test_merge_outputs_concatenates_deltas() -> None:
    a = RequestOutput("r", [1], "a", num_output_tokens=1, new_logprobs=[-0.1])
    b = RequestOutput(
        "r",
        [2, 3],
        "bc",
        finished=True,
        finish_reason=FinishReason.STOP,
        num_output_tokens=3,
        new_logprobs=[-0.2, -0.3],
    )
    m = merge_outputs(a, b)
    assert (m.new_token_ids, m.new_text, m.new_logprobs) == ([1, 2, 3], "abc", [-0.1, -0.2, -0.3])
    assert (m.finished, m.finish_reason, m.num_output_tokens) == (True, FinishReason.STOP, 3)
