"""Fixtures for the torch side of the engine: tiny random Llama folders, the transformers reference, a
minimal hand-driven stand-in for the scheduler (`Driver`) that feeds the ModelRunner SchedulerOutputs, and the
native extension where it runs AMX (`amx`: the test skips elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from worker.core.outputs import ScheduledSeq, SchedulerOutput
from worker.core.request import SamplingParams
from worker.model.testing import make_tiny_llama

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


@dataclass
class Seq:
    """One request as the driver tracks it (prompt + generated tokens, computed count, block table)."""

    req_id: str
    tokens: list[int]
    max_tokens: int
    params: SamplingParams = GREEDY
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens


class Driver:
    """Schedules by hand: each `step` runs every given sequence for up to `chunk` tokens (all pending if None)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        self.finished: set[str] = set()

    def alloc(self, seq: Seq, num_tokens: int) -> None:
        bs = self.runner.block_size
        while len(seq.blocks) * bs < num_tokens:
            seq.blocks.append(self.free.pop(0))

    def release(self, seq: Seq) -> None:
        self.free.extend(seq.blocks)
        seq.blocks = []

    def preempt(self, seq: Seq) -> None:
        """Recompute-style preemption: the KV is gone, the tokens stay."""
        self.release(seq)
        seq.computed = 0

    def step(self, seqs: list[Seq], chunk: int | None = None) -> None:
        scheduled = []
        for seq in seqs:
            n = len(seq.tokens) - seq.computed
            if chunk is not None:
                n = min(n, chunk)
            self.alloc(seq, seq.computed + n)
            scheduled.append(
                ScheduledSeq(
                    req_id=seq.req_id,
                    token_ids=seq.tokens[seq.computed : seq.computed + n],
                    start_pos=seq.computed,
                    block_ids=list(seq.blocks),
                    sample=seq.computed + n == len(seq.tokens),
                    sampling_params=seq.params,
                    num_output_tokens=len(seq.output),
                )
            )
        finished, self.finished = frozenset(self.finished), set()
        out = self.runner.execute_model(
            SchedulerOutput(
                seqs=scheduled, num_batched_tokens=sum(len(s.token_ids) for s in scheduled), finished_req_ids=finished
            )
        )
        for seq, s in zip(seqs, scheduled):
            seq.computed += len(s.token_ids)
            if s.sample:
                assert set(out.sampled_token_ids) >= {seq.req_id}
                tok = out.sampled_token_ids[seq.req_id]
                seq.tokens.append(tok)
                seq.output.append(tok)
                if seq.req_id in out.logprobs:
                    seq.logprobs.append(out.logprobs[seq.req_id])
            else:
                assert seq.req_id not in out.sampled_token_ids

    def run(self, seqs: list[Seq], chunk: int | None = None, max_steps: int = 10_000) -> None:
        """Step all unfinished sequences together until each has its max_tokens (ignoring EOS)."""
        for _ in range(max_steps):
            active = [s for s in seqs if not s.done]
            if not active:
                return
            self.step(active, chunk)
            for s in active:
                if s.done:
                    self.release(s)
                    self.finished.add(s.req_id)
        raise AssertionError("driver did not finish within max_steps")


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation from the transformers reference (explicit loop: EOS does not stop it)."""
    out: list[int] = []
    past = None
    x = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            o = model(x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            tok = int(o.logits[0, -1].argmax())
            out.append(tok)
            x = torch.tensor([[tok]])
    return out


def load_hf(path, dtype=torch.float32):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """GQA (6 query heads over 2 KV heads), hidden 72, intermediate 100, untied head."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), num_hidden_layers=2)


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    return load_hf(tiny_dir)


class CountingCalls:
    """An object (the extension, say) with its calls to one method counted in `calls`; everything else passes
    through: did a step take the path it should?"""

    def __init__(self, inner, method: str) -> None:
        self._inner, self._method, self.calls = inner, method, 0

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr

        def counted(*args):
            self.calls += 1
            return attr(*args)

        return counted


@pytest.fixture
def counting_cls():
    return CountingCalls


@pytest.fixture
def driver_cls():
    return Driver


@pytest.fixture
def seq_cls():
    return Seq


@pytest.fixture
def hf_greedy_fn():
    return hf_greedy


@pytest.fixture
def load_hf_fn():
    return load_hf


def _native_or_skip(ready: str, missing: str):
    """The native extension where it builds and its `ready()` check passes (else the test is skipped)."""
    from worker.model.kernels import _load_module

    module, why = _load_module()
    if module is None:
        pytest.skip(f"native extension cannot be built here: {why}")
    if not getattr(module, ready)():
        pytest.skip(missing)
    return module


@pytest.fixture(scope="session")
def avx512():
    """The native extension, on a CPU where its kernels take their AVX-512 paths (else the test is skipped)."""
    module = _native_or_skip("f32_panels_ready", "this CPU has neither AVX-512 nor AVX2 + FMA")
    if module.vector_isa() != "avx512":
        pytest.skip("this CPU has no AVX512F")
    return module


@pytest.fixture(scope="session")
def f32_attention():
    """The native extension, on a CPU where its fp32 prompt attention runs: AVX-512, or AVX2 + FMA (else the test
    is skipped)."""
    return _native_or_skip("f32_attention_ready", "this CPU has neither AVX-512 nor AVX2 + FMA")


@pytest.fixture(scope="session")
def panels():
    """The native extension, on a CPU where its fp32 panel linear runs: AVX-512, or AVX2 + FMA (else the test is
    skipped)."""
    return _native_or_skip("f32_panels_ready", "this CPU has neither AVX-512 nor AVX2 + FMA")


@pytest.fixture(scope="session")
def fp32_code_panels(panels):
    """`panels` as a CPU without AVX512-BF16 sees it (`testing.Fp32PanelsOnly`): quantized layers of an fp32 model
    on the fp32 code panels."""
    from worker.model.testing import Fp32PanelsOnly

    return Fp32PanelsOnly(panels)


@pytest.fixture(scope="session")
def bf16_panels():
    """The native extension, on a CPU where its bf16 panel linear runs: AVX512-BF16 (else the test is skipped)."""
    return _native_or_skip("bf16_panels_ready", "this CPU has no AVX512-BF16")


@pytest.fixture(scope="session")
def bf16_attention():
    """The native extension, on a CPU where its bf16 prompt attention without AMX runs: AVX512-BF16 (else the test
    is skipped)."""
    return _native_or_skip("bf16_attention_ready", "this CPU has no AVX512-BF16")


@pytest.fixture(scope="session")
def amx():
    """The native extension, on a CPU whose AMX-BF16 the OS lets it use (else the test is skipped)."""
    return _native_or_skip("amx_linear_ready", "this CPU (or its kernel) offers no AMX-BF16")
