"""ModelRunner: loads a model folder, owns the paged KV cache, and runs one scheduler step at a time.

The seam with the scheduler is `worker.core.outputs`: `execute_model(SchedulerOutput) -> ModelRunnerOutput`.
The runner is stateless with respect to scheduling (block tables, positions and what to sample all arrive
with each step); its only per-request state is the seeded `torch.Generator` of requests that asked for a seed,
dropped when their id shows up in `finished_req_ids`. A preempted request keeps its generator: recompute
re-derives only the KV cache, so its next draw continues the same random stream as if never interrupted.

Each step is one flattened batch: single-token sequences first (they attend in one batched call), then
multi-token chunks; logits are computed only for the rows that sample. A sequence with draft tokens (speculative
decoding) samples at its last known token and at every draft; the sampler verifies the drafts
(`Sampler.verify`) and the tokens the request gains go to `ModelRunnerOutput.verified_token_ids`.

LoRA (`max_loras` > 0): a sequence names its adapter and the slot the scheduler gave it; the runner loads the
adapter into that slot when the slot holds another one (`lora_slots`), orders the batch so each adapter's rows are
contiguous, and the model adds each run's deltas (`worker.model.lora`).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch

from worker.core.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from worker.core.request import Logprob
from worker.model.attention import EAGER, NativeAttention, SeqSpan, build_metadata, cache_shape, cache_views
from worker.model.config import ModelConfig
from worker.model.kernels import (
    head_major_cache,
    load_argmax,
    load_extension,
    load_fused_ops,
    load_kv_write,
    load_paged_decode,
    load_prefill_attention,
    load_quant_amx_ops,
    paged_decode_path,
)
from worker.model.linear import available_kernels, read_cpu_flags, resolve_auto_dtype
from worker.model.llama import LlamaModel
from worker.model.loader import load_weights
from worker.model.lora import LoadedLora, LoraError, LoraStore, load_lora, plan_batch
from worker.model.memory import huge_page_zeros, keep_freed_memory_mapped
from worker.model.quant import QUANTIZATIONS
from worker.model.sampler import Sampler, SampleRequest, top_tokens
from worker.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_KV_CACHE_BYTES = 512 * 1024**2
PROMPT_LOGPROBS_ROWS = 256  # prompt positions scored at once: bounds the [rows, vocab] logits (~50 MB for SmolLM2)
DEFAULT_MAX_SEQS_OF_CACHE = 8  # default cache: room for this many max_model_len sequences (if under the bytes)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers: K and V, each [block_size, kv_heads, head_dim] per layer."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def plan_num_blocks(
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    num_blocks: int | None,
    kv_cache_bytes: int | None,
) -> int:
    """How many KV blocks to allocate: explicit count, else from a byte budget, else a modest default."""
    if num_blocks is not None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        return num_blocks
    if kv_cache_bytes is not None:
        n = kv_cache_bytes // block_bytes
        if n < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} holds no KV block of {block_bytes} bytes; give at least that"
            )
        return n
    per_seq = -(-max_model_len // block_size)
    return max(per_seq, min(DEFAULT_KV_CACHE_BYTES // block_bytes, DEFAULT_MAX_SEQS_OF_CACHE * per_seq))


class ModelRunner:
    """A Llama-family model with its paged KV cache, tokenizer and sampler."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        quantization: str | None = None,
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        max_loras: int = 0,
        max_lora_rank: int = 16,
    ) -> None:
        """`max_loras` > 0 serves LoRA adapters (that many resident at once) of rank at most `max_lora_rank`."""
        self.dtype_reason = "asked for"
        if dtype == "auto":
            cpu = torch.device(device).type == "cpu"
            flags = read_cpu_flags() if cpu else frozenset()
            # the extension's kernels where they will run, so the reason names the kernel the model then takes
            native = load_extension() if cpu and not enforce_eager else None
            dtype, self.dtype_reason = resolve_auto_dtype(device, flags, available_kernels(native))
            logging.getLogger(__name__).info("dtype auto -> %s: %s", dtype, self.dtype_reason)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
        if quantization not in (None, "none", *QUANTIZATIONS):
            raise ValueError(f"quantization must be none or one of {QUANTIZATIONS}, got {quantization!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if torch.device(device).type == "cpu":
            keep_freed_memory_mapped()
        self.model_path = str(Path(model_path))
        self.config = ModelConfig.from_dir(model_path)
        self.vocab_size: int = self.config.vocab_size
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.quantization = None if quantization in (None, "none") else quantization
        self.block_size = block_size
        limit = self.config.max_position_embeddings
        if max_model_len is not None and not 0 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] (the model's max_position_embeddings)")
        self.max_model_len = max_model_len or limit
        self.tokenizer = Tokenizer(model_path)
        eos = self.tokenizer.eos_token_id
        self.eos_token_id: int | None = eos if eos is not None else next(iter(self.config.eos_token_ids), None)
        self.fused_reason = "torch ops: the fused ones run on CPU, without enforce_eager"
        fused = quant_amx = None
        if not enforce_eager and self.device.type == "cpu":
            cfg = self.config
            fused, self.fused_reason = load_fused_ops(self.dtype, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim)
            if self.quantization is not None and self.dtype == torch.float32:
                sizes = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim)
                quant_amx, why = load_quant_amx_ops(self.dtype, self.quantization, *sizes)
                logging.getLogger(__name__).info("quantized linears of this fp32 model: %s", why)
        logging.getLogger(__name__).info("layer elementwise steps: %s", self.fused_reason)
        with torch.inference_mode():
            weights = load_weights(model_path, self.dtype)
            self.model = LlamaModel(
                self.config,
                weights,
                dtype=self.dtype,
                device=self.device,
                quantization=self.quantization,
                fused=fused,
                quant_amx=quant_amx,
            )
        del weights
        self.block_bytes = kv_block_bytes(self.config, block_size, self.dtype)
        self.num_blocks = plan_num_blocks(self.block_bytes, block_size, self.max_model_len, num_blocks, kv_cache_bytes)
        cfg = self.config
        # Decode attention through the native paged kernel (reads K/V straight from the cache: 3x faster than
        # gather + SDPA on CPU); the eager torch path remains when asked for, on other devices, or when the
        # kernel cannot be built here.
        # The native cache write, prompt attention (`load_prefill_attention` says which) and greedy argmax come
        # from the same extension.
        self.native = EAGER
        argmax = None
        self.kernel_error: str | None = None
        if not enforce_eager and self.device.type == "cpu":
            decode, self.kernel_error = load_paged_decode()
            prefill, prefill_why = load_prefill_attention(self.dtype, cfg.head_dim)
            self.native = NativeAttention(decode, load_kv_write()[0], prefill)
            argmax = load_argmax()[0]
            if self.kernel_error:
                warnings.warn(
                    f"decode attention runs eagerly: native kernel unavailable ({self.kernel_error})", stacklevel=2
                )
            else:
                logging.getLogger(__name__).info(
                    "decode attention: native paged kernel, %s", paged_decode_path(self.dtype, cfg.head_dim)
                )
            logging.getLogger(__name__).info("prompt attention: %s", prefill_why)
        # Head-major where the native decode kernel reads it (attention.cache_views; kernels.py says what it gains)
        self.head_major = self.native.decode is not None and head_major_cache(self.dtype, cfg.head_dim, block_size)
        # Zero-filled: masked-out slots are multiplied by zero weights, and garbage NaNs would poison them. On CPU in
        # transparent huge pages (memory.huge_page_zeros says why).
        shape = cache_shape(
            cfg.num_hidden_layers, self.num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, self.head_major
        )
        if self.device.type == "cpu":
            self.kv_cache, huge = huge_page_zeros(shape, self.dtype)
            logging.getLogger(__name__).info(
                "KV cache: %.1f MB, huge pages %s, %s",
                self.kv_cache_bytes / 1e6,
                huge,
                "head-major" if self.head_major else "token-major",
            )
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = cache_views(self.kv_cache, self.head_major)
        self._generators: dict[str, torch.Generator] = {}
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        # slot -> lora_id of the adapter resident there (its weights are in lora_store); the scheduler decides
        self.lora_slots: list[int | None] = [None] * max_loras
        self.lora_store = (
            LoraStore(self.config, max_loras, max_lora_rank, self.dtype, self.device) if max_loras > 0 else None
        )
        if self.lora_store is not None:
            logging.getLogger(__name__).info(
                "LoRA: %d adapter slots of rank <= %d hold %.1f MB",
                max_loras,
                max_lora_rank,
                self.lora_store.nbytes / 1e6,
            )
        unseeded = torch.Generator(device=self.device).manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.sampler = Sampler(unseeded, argmax)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def weight_bytes(self) -> int:
        return self.model.nbytes

    @property
    def seeded_request_ids(self) -> frozenset[str]:
        """Requests whose seeded generator the runner still holds (until they appear in finished_req_ids)."""
        return frozenset(self._generators)

    def _generator(self, req_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(req_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[req_id] = gen
        return gen

    def _scratch_caches(self, num_tokens: int) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
        """A private cache for offline helpers, so they never touch blocks the scheduler owns."""
        blocks = -(-num_tokens // self.block_size)
        cfg = self.config
        shape = cache_shape(
            cfg.num_hidden_layers, blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim, self.head_major
        )
        scratch = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return list(range(blocks)), cache_views(scratch, self.head_major)

    def load_lora(self, path: str, name: str = "") -> LoadedLora:
        """Read and validate a PEFT adapter for this model, on its device and dtype (raises LoraError)."""
        if self.max_loras < 1:
            raise LoraError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)")
        return load_lora(
            path, self.config, max_rank=self.max_lora_rank, dtype=self.dtype, device=self.device, name=name
        )

    def _lora_batch(self, seqs: list[ScheduledSeq], out: ModelRunnerOutput) -> dict[str, int]:
        """Load the adapters this step's sequences name into their slots (where a slot holds another one); a
        sequence whose adapter cannot be loaded (its files changed or went away) fails alone. Returns the slot of
        each remaining adapter sequence."""
        slots: dict[str, int] = {}
        for seq in seqs:
            spec, slot = seq.lora, seq.lora_slot
            if spec is None or seq.req_id in out.failed:
                continue
            try:
                if not 0 <= slot < self.max_loras:
                    raise ValueError(f"adapter slot {slot} is outside 0..{self.max_loras - 1}")
                if self.lora_slots[slot] != spec.lora_id:
                    assert self.lora_store is not None
                    loaded = self.load_lora(spec.path, spec.name)
                    self.lora_slots[slot] = None
                    self.lora_store.put(slot, loaded)
                    self.lora_slots[slot] = spec.lora_id
            except Exception as exc:  # noqa: BLE001 - this sequence's alone
                out.failed[seq.req_id] = failure(exc)
                continue
            slots[seq.req_id] = slot
        return slots

    def _index(self, rows: list[int] | None) -> torch.Tensor | None:
        return None if rows is None else torch.tensor(rows, dtype=torch.int64, device=self.device)

    def _check_offline_length(self, n: int) -> None:
        if not 0 < n <= self.max_model_len:
            raise ValueError(f"need 1..{self.max_model_len} tokens, got {n}")

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [n, vocab] at every position of one sequence (teacher forcing), for quality checks."""
        n = len(token_ids)
        self._check_offline_length(n)
        table, caches = self._scratch_caches(n)
        meta = build_metadata([SeqSpan(0, n, table)], self.block_size, self.device, self.dtype)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(self.model.forward(ids, meta, caches, self.native))

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation of one prompt (EOS does not stop it), offline, on a private cache."""
        self._check_offline_length(len(prompt) + max_tokens)
        table, caches = self._scratch_caches(len(prompt) + max_tokens)
        tokens = list(prompt)
        start = 0
        for _ in range(max_tokens):
            new = tokens[start:]
            span = SeqSpan(start, len(new), table)
            meta = build_metadata([span], self.block_size, self.device, self.dtype, self.native.decode is not None)
            ids = torch.tensor(new, dtype=torch.int64, device=self.device)
            hidden = self.model.forward(ids, meta, caches, self.native, rows=self._index([len(new) - 1]))
            start = len(tokens)
            tokens.append(int(self.model.compute_logits(hidden).argmax()))
        return tokens[len(prompt) :]

    def _prompt_logprobs(self, hidden: torch.Tensor, first_row: int, seq: ScheduledSeq) -> list[Logprob]:
        """Logprobs (and top-k) of the prompt tokens that `seq`'s rows predict, in slices of rows so that a long
        prompt never holds [tokens, vocab] logits at once."""
        k = seq.sampling_params.prompt_logprobs or 0
        targets = torch.tensor(seq.prompt_targets, dtype=torch.int64, device=self.device)
        result: list[Logprob] = []
        for start in range(0, len(targets), PROMPT_LOGPROBS_ROWS):
            rows = hidden[first_row + start : first_row + min(start + PROMPT_LOGPROBS_ROWS, len(targets))]
            lp = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            chosen = lp.gather(1, targets[start : start + len(rows), None]).squeeze(1).tolist()
            result.extend(Logprob(value, top_tokens(lp[i], k)) for i, value in enumerate(chosen))
        return result

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. A failure that belongs to one sequence (a shape the scheduler should never send, a
        generator its seed cannot build, a row the sampler cannot draw) ends that sequence in `out.failed`; the
        rest of the batch runs as if it were not there. Only a failure of the batch itself raises."""
        for req_id in sched.finished_req_ids:
            self._generators.pop(req_id, None)
        out = ModelRunnerOutput()
        # Single-token sequences first: they attend together in one batched call. Within each part, sequences of
        # one adapter are next to each other, so its rows are one run (base sequences, slot -1, come first).
        seqs = sorted(sched.seqs, key=lambda s: (len(s.token_ids) != 1, s.lora_slot))
        lora_slots = self._lora_batch(seqs, out) if self.max_loras else {}
        row_slots: list[tuple[int, int, int]] = []
        input_ids: list[int] = []
        spans: list[SeqSpan] = []
        sampled: list[tuple[ScheduledSeq, int, SampleRequest]] = []  # (seq, its row, how to sample it)
        prompt_rows: list[tuple[ScheduledSeq, int]] = []  # (seq, row of its first token) for prompt logprobs
        for seq in seqs:
            try:
                self._check_seq(seq)
                request = self._sample_request(seq) if seq.sample else None
            except Exception as exc:  # noqa: BLE001 - this sequence's alone: it leaves the batch
                out.failed[seq.req_id] = failure(exc)
                continue
            if seq.req_id in out.failed:
                continue
            if seq.prompt_targets:
                prompt_rows.append((seq, len(input_ids)))
            if seq.req_id in lora_slots:
                row_slots.append((len(input_ids), len(input_ids) + len(seq.token_ids), lora_slots[seq.req_id]))
            input_ids.extend(seq.token_ids)
            spans.append(SeqSpan(seq.start_pos, len(seq.token_ids), seq.block_ids))
            if request is not None:
                sampled.append((seq, len(input_ids) - 1, request))
        if not spans:
            return out
        meta = build_metadata(spans, self.block_size, self.device, self.dtype, self.native.decode is not None)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        lora = None
        if row_slots and self.lora_store is not None:
            lora = plan_batch(self.lora_store, row_slots, meta.num_decode, self.dtype, self.device)
        # Every row is read where each sequence is one sampled token (a decode step): no rows to map, and none
        # to gather (a set and a sort of 64 rows cost ~10 us a step).
        every_row = not prompt_rows and len(sampled) == len(input_ids)
        read = read_rows(prompt_rows, sampled) if lora is None and not every_row else None
        if read is not None and len(read) == len(input_ids):
            read = None  # every row is read all the same (a step of drafts and their last tokens)
        hidden = self.model.forward(ids, meta, self.kv_caches, self.native, lora, self._index(read))
        at = {row: i for i, row in enumerate(read)} if read is not None else None  # batch row -> row of hidden
        for seq, first_row in prompt_rows:
            try:
                out.prompt_logprobs[seq.req_id] = self._prompt_logprobs(
                    hidden, at[first_row] if at is not None else first_row, seq
                )
            except Exception as exc:  # noqa: BLE001
                out.failed[seq.req_id] = failure(exc)
        sampled = [entry for entry in sampled if entry[0].req_id not in out.failed]
        if not sampled:
            return out
        # Rows to score: one per plain sequence (first), then 1 + len(drafts) per speculating one.
        plain = [entry for entry in sampled if not entry[0].draft_token_ids]
        speculating = [entry for entry in sampled if entry[0].draft_token_ids]
        row_ids = [row for seq, last_row, _ in plain + speculating for row in sampled_rows(seq, last_row)]
        if at is not None:
            row_ids = [at[row] for row in row_ids]
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(row_ids, device=self.device)))
        first = len(plain)
        for seq, _, request in speculating:
            k = len(seq.draft_token_ids)
            try:
                out.verified_token_ids[seq.req_id] = self.sampler.verify(
                    logits[first : first + k + 1], seq.draft_token_ids, request
                )
            except Exception as exc:  # noqa: BLE001 - this sequence's alone
                out.failed[seq.req_id] = failure(exc)
            first += k + 1
        if not plain:
            return out
        sampled = plain
        if speculating:
            logits = logits[: len(plain)]
        tokens, logprobs, errors = self.sampler(logits, [request for _, _, request in sampled])
        for i, (seq, _, _) in enumerate(sampled):
            if i in errors:
                out.failed[seq.req_id] = failure(errors[i])
                continue
            out.sampled_token_ids[seq.req_id] = tokens[i]
            logprob = logprobs[i]
            if logprob is not None:
                out.logprobs[seq.req_id] = logprob.logprob
                if logprob.top:
                    out.top_logprobs[seq.req_id] = logprob.top
        return out

    def _check_seq(self, seq: ScheduledSeq) -> None:
        n = len(seq.token_ids)
        if n == 0:
            raise ValueError(f"request {seq.req_id} was scheduled with no tokens")
        if seq.start_pos + n > self.max_model_len:
            raise ValueError(
                f"request {seq.req_id} reaches {seq.start_pos + n} tokens, over max_model_len={self.max_model_len}"
            )

    def _sample_request(self, seq: ScheduledSeq) -> SampleRequest:
        return SampleRequest(
            params=seq.sampling_params,
            generator=self._generator(seq.req_id, seq.sampling_params.seed),
            num_output_tokens=seq.num_output_tokens,
            eos_token_id=seq.eos_token_id if seq.eos_token_id is not None else self.eos_token_id,
        )


def read_rows(
    prompt_rows: list[tuple[ScheduledSeq, int]], sampled: list[tuple[ScheduledSeq, int, SampleRequest]]
) -> list[int]:
    """The batch rows a step reads from the model's hidden states, ascending: each prompt-logprob sequence's
    rows (one per prompt target, from its first row), each sampled sequence's last row and, for a speculating
    one, the rows of its drafts before it. A contiguous run of rows stays contiguous in the result."""
    rows = {first + i for seq, first in prompt_rows for i in range(len(seq.prompt_targets))}
    for seq, last, _ in sampled:
        rows.update(sampled_rows(seq, last))
    return sorted(rows)


def sampled_rows(seq: ScheduledSeq, last: int) -> range:
    """The rows whose logits a sampled sequence needs, its last row `last`: that row alone, or with speculation
    its drafts' rows before it too (the target model's verdict on each draft)."""
    return range(last - len(seq.draft_token_ids), last + 1)


def failure(exc: BaseException) -> str:
    """How a sequence's failure is reported to its client."""
    return f"{type(exc).__name__}: {exc}"
