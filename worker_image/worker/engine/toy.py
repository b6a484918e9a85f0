"""A torch-free stand-in for the model runner and tokenizer, for tests and the scheduler benchmark.

`ToyRunner` honours the same contract as `worker.model.runner.ModelRunner`: it writes each scheduled token
into a paged "KV cache" (one slot per token, addressed through the block table like real KV) and, when asked to
sample, reads the whole context back through the block table and derives the next token from it. So a wrong
block table, a stale or shared-by-mistake block, a wrong start position or a missing recompute changes the
output or fails loudly, exactly the mistakes a scheduler can make; yet it costs microseconds per token.
Drafts (speculative decoding) are verified as the torch runner does (`worker.core.spec_decode`): the next token
is derived at each draft position from the context read back through the block table, drafts included, until the
first one that differs.

`ByteTokenizer` maps UTF-8 bytes to ids 0..255 (256 is EOS), so multi-byte characters span several tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from worker.core.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from worker.core.request import Logprob, SamplingParams

EOS = 256


class ByteTokenizer:
    """Bytes as tokens; EOS (256) is the only special token."""

    eos_token_id = EOS
    vocab_size = EOS + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i < EOS:
                out.append(i)
            elif not skip_special_tokens:
                out += b"</s>"
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


def context_hash(context: Sequence[int]) -> int:
    h = 0
    for t in context:
        h = (h * 1_000_003 + t + 1) & 0xFFFF_FFFF_FFFF
    return h ^ (h >> 17)


def toy_next_token(context: Sequence[int], draw: int = 0) -> int:
    """The toy model: a deterministic function of the whole context (plus a random draw when sampling).

    Mostly lowercase letters, some spaces, EOS about once in 64 tokens.
    """
    r = (context_hash(context) + draw) % 64
    if r == 0:
        return EOS
    if r < 8:
        return ord(" ")
    return ord("a") + r % 26


def toy_logprob(context: Sequence[int]) -> float:
    return -(context_hash(context) % 100) / 100.0


def toy_top(context: Sequence[int], k: int) -> tuple[tuple[int, float], ...]:
    """The toy model's top-k after `context`: its greedy token first, then the following ids."""
    first = toy_next_token(context)
    return tuple(((first + i) % (EOS + 1), -float(i)) for i in range(k))


class ToyRunner:
    """Implements `execute_model(SchedulerOutput) -> ModelRunnerOutput` over a simulated paged KV cache."""

    def __init__(
        self,
        num_blocks: int = 256,
        block_size: int = 16,
        max_model_len: int = 4096,
        next_token: Callable[[Sequence[int], int], int] = toy_next_token,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.tokenizer = ByteTokenizer()
        self.vocab_size = ByteTokenizer.vocab_size
        self.eos_token_id = EOS
        self._next_token = next_token
        # slot -> (position, token): a KV entry remembers which position it was written for.
        self._kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self._rngs: dict[str, random.Random] = {}
        self.num_steps = 0

    @property
    def num_request_states(self) -> int:
        """Per-request sampling states still held (dropped when the scheduler reports the request finished)."""
        return len(self._rngs)

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for req_id in scheduler_output.finished_req_ids:
            self._rngs.pop(req_id, None)
        if sum(len(s.token_ids) for s in scheduler_output.seqs) != scheduler_output.num_batched_tokens:
            raise AssertionError("num_batched_tokens does not match the scheduled tokens")
        for seq in scheduler_output.seqs:
            end = seq.start_pos + len(seq.token_ids)
            if not seq.token_ids or end > len(seq.block_ids) * self.block_size:
                raise AssertionError(f"{seq.req_id}: block table too short for positions up to {end}")
            for offset, token in enumerate(seq.token_ids):
                pos = seq.start_pos + offset
                self._kv[self._slot(seq.block_ids, pos)] = (pos, token)
        out = ModelRunnerOutput()
        for seq in scheduler_output.seqs:
            if not seq.sample:
                continue
            if seq.draft_token_ids:
                try:
                    out.verified_token_ids[seq.req_id] = self._verify(seq)
                except Exception as exc:  # noqa: BLE001
                    out.failed[seq.req_id] = f"{type(exc).__name__}: {exc}"
                continue
            context = self._read_context(seq.req_id, seq.block_ids, seq.start_pos + len(seq.token_ids))
            try:  # like the real runner: a failure in one sequence's sampling ends that sequence only
                token = self._next_token(context, self._draw(seq.req_id, seq.sampling_params))
            except Exception as exc:  # noqa: BLE001
                out.failed[seq.req_id] = f"{type(exc).__name__}: {exc}"
                continue
            out.sampled_token_ids[seq.req_id] = token
            if seq.sampling_params.logprobs:
                out.logprobs[seq.req_id] = toy_logprob(context)
                if seq.sampling_params.top_logprobs:
                    out.top_logprobs[seq.req_id] = toy_top(context, seq.sampling_params.top_logprobs)
        for seq in scheduler_output.seqs:
            if seq.prompt_targets:
                k = seq.sampling_params.prompt_logprobs or 0
                contexts = [
                    self._read_context(seq.req_id, seq.block_ids, seq.start_pos + i + 1)
                    for i in range(len(seq.prompt_targets))
                ]
                out.prompt_logprobs[seq.req_id] = [
                    Logprob(toy_logprob([*c, t]), toy_top(c, k)) for c, t in zip(contexts, seq.prompt_targets)
                ]
        return out

    def _verify(self, seq: ScheduledSeq) -> list[int]:
        """The next token at the last known position and after each draft, until the first draft that differs."""
        drafts = seq.draft_token_ids
        known_end = seq.start_pos + len(seq.token_ids) - len(drafts)
        out: list[int] = []
        for i in range(len(drafts) + 1):
            context = self._read_context(seq.req_id, seq.block_ids, known_end + i)
            token = self._next_token(context, self._draw(seq.req_id, seq.sampling_params))
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                break
        return out

    def _read_context(self, req_id: str, block_ids: list[int], length: int) -> list[int]:
        context = []
        for pos in range(length):
            entry = self._kv[self._slot(block_ids, pos)]
            if entry is None or entry[0] != pos:
                raise AssertionError(f"{req_id}: KV slot for position {pos} holds {entry}")
            context.append(entry[1])
        return context

    def _draw(self, req_id: str, params: SamplingParams) -> int:
        if params.greedy:
            return 0
        rng = self._rngs.get(req_id)
        if rng is None:
            rng = self._rngs[req_id] = random.Random(params.seed)
        return rng.randrange(1 << 30)
