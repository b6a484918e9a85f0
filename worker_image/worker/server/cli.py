"""`llmfleet worker`: run the engine behind the OpenAI-compatible server (light module: heavy imports inside)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from worker.server.settings import DEFAULT_PORT, default_host

_ENGINE_HELP = "builtin (ours), vllm (vLLM AsyncLLM in-process), fake (tests only: no model)"


def parse_extra_flags(argv: list[str]) -> dict[str, Any]:
    """`--gpu-memory-utilization 0.9 --enforce-eager` -> {"gpu_memory_utilization": 0.9, "enforce_eager": True}.

    Values are read as YAML scalars (numbers, booleans, strings); a flag followed by another flag or nothing is True.
    """
    import yaml

    flags: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or len(token) == 2:
            raise ValueError(f"unexpected argument {token!r}: extra engine flags look like --name [value]")
        name, eq, inline = token[2:].partition("=")
        key = name.replace("-", "_")
        if eq:
            flags[key] = yaml.safe_load(inline)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[key] = yaml.safe_load(argv[i + 1])
            i += 1
        else:
            flags[key] = True
        i += 1
    return flags


def parse_speculative_config(text: str | None) -> dict[str, Any] | None:
    """The JSON object of --speculative-config (validated by the settings), or None when not given."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f'--speculative-config is not JSON ({err.msg}): give e.g. \'{{"method": "ngram"}}\'') from err
    if not isinstance(value, dict):
        raise ValueError('--speculative-config must be a JSON object, e.g. \'{"method": "ngram"}\'')
    return value


def parse_lora_modules(values: list[str] | None) -> dict[str, str]:
    """`--lora-modules name=path` (repeatable; vLLM's spelling, also its JSON `{"name": .., "path": ..}`)."""
    modules: dict[str, str] = {}
    for value in values or []:
        text = value.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
                name, path = obj["name"], obj["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f'--lora-modules {value!r}: give name=path or {{"name": .., "path": ..}}') from err
        else:
            name, eq, path = text.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: give name=path (a PEFT adapter folder)")
        if name in modules:
            raise ValueError(f"--lora-modules names the adapter {name!r} twice")
        modules[str(name)] = str(path)
    return modules


def worker_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", help="bundled://NAME, a model folder or hf://ORG/REPO")],
    revision: Annotated[str | None, typer.Option(help="model revision (hf:// sources)")] = None,
    engine: Annotated[str, typer.Option(help=_ENGINE_HELP)] = "builtin",
    quantization: Annotated[str, typer.Option(help="none | int8 | fp8 | int4 (weight-only)")] = "none",
    dtype: Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda (builtin engine)")] = "auto",
    host: Annotated[str | None, typer.Option(help="bind address (default: $POD_IP, else 127.0.0.1)")] = None,
    port: Annotated[int, typer.Option(help="port (0: any free port)")] = DEFAULT_PORT,
    served_model_name: Annotated[str | None, typer.Option(help="the `model` clients send")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="context length (prompt + output)")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="requests running at once")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="tokens computed per step")] = None,
    kv_cache_bytes: Annotated[int | None, typer.Option(help="KV-cache size in bytes")] = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="reuse KV of shared prompt prefixes")] = True,
    enable_chunked_prefill: Annotated[bool, typer.Option(help="split long prompts over several steps")] = True,
    speculative_config: Annotated[
        str | None,
        typer.Option(
            help='speculative decoding by prompt lookup, as vLLM\'s JSON: {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} '
            '(+ "disable_by_batch_size", builtin engine only)'
        ),
    ] = None,
    enable_lora: Annotated[bool, typer.Option("--enable-lora", help="serve LoRA adapters (either engine)")] = False,
    max_loras: Annotated[int | None, typer.Option(help="LoRA adapters resident at once (default 1)")] = None,
    max_lora_rank: Annotated[int | None, typer.Option(help="largest LoRA rank accepted (default 16)")] = None,
    lora_modules: Annotated[
        list[str] | None,
        typer.Option(help="adapter to serve from the start, name=path (PEFT folder); repeat for more"),
    ] = None,
    max_waiting: Annotated[int, typer.Option(help="waiting requests before new ones get 429")] = 256,
    max_tokens_cap: Annotated[int | None, typer.Option(help="largest max_tokens a request may ask for")] = None,
    max_tokens_policy: Annotated[str, typer.Option(help="reject (400) | clamp, above the cap/context")] = "reject",
    request_timeout: Annotated[float | None, typer.Option(help="per-request deadline in seconds")] = None,
    drain_timeout: Annotated[float, typer.Option(help="seconds a drain waits for in-flight requests")] = 30.0,
    drain_token_file: Annotated[
        Path | None, typer.Option(help="file with the bearer token of POST /drain (default: $LLMFLEET_DRAIN_TOKEN)")
    ] = None,
    retry_after: Annotated[int, typer.Option(help="Retry-After seconds of 429/503 answers")] = 1,
    tokenizer_threads: Annotated[int, typer.Option(help="threads that tokenize prompts off the event loop")] = 2,
    max_body_bytes: Annotated[int, typer.Option(help="largest request body in bytes (413 above)")] = 8 * 1024 * 1024,
    log_level: Annotated[str, typer.Option(help="debug | info | warning | error")] = "info",
    fake_ttft_ms: Annotated[float, typer.Option(hidden=True, help="fake engine: delay before the first token")] = 0.0,
    fake_itl_ms: Annotated[float, typer.Option(hidden=True, help="fake engine: delay between tokens")] = 0.0,
    fake_gate_file: Annotated[
        Path | None, typer.Option(hidden=True, help="fake engine: requests pause after one token until it exists")
    ] = None,
) -> None:
    """Run a worker: engine + OpenAI-compatible server, /metrics, /health, /ready, /drain.

    SIGTERM (or POST /drain) drains: /ready fails, new requests get 503, in-flight requests finish (for at most
    --drain-timeout, then what is left is aborted). After SIGTERM the process then exits 0; after POST /drain it
    stays up, idle, until SIGTERM (a pod about to be deleted must not be restarted by the kubelet).
    """
    from pydantic import ValidationError

    from worker.server.engines import FakeOptions, build_engine
    from worker.server.serve import WorkerServer
    from worker.server.settings import FaultSettings, WorkerSettings, read_drain_token

    try:
        settings = WorkerSettings(
            engine_extra_args=parse_extra_flags(list(ctx.args)),
            model=model,
            revision=revision,
            served_model_name=served_model_name,
            engine=engine,
            quantization=quantization,
            dtype=dtype,
            host=host or default_host(),
            port=port,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_bytes=kv_cache_bytes,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            speculative=parse_speculative_config(speculative_config),
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            lora_modules=parse_lora_modules(lora_modules),
            max_waiting=max_waiting,
            max_tokens_cap=max_tokens_cap,
            max_tokens_policy=max_tokens_policy,
            request_timeout_s=request_timeout,
            drain_timeout_s=drain_timeout,
            drain_token=read_drain_token(drain_token_file, os.environ),
            retry_after_s=retry_after,
            max_body_bytes=max_body_bytes,
            tokenizer_threads=tokenizer_threads,
            faults=FaultSettings.from_env(os.environ),
        )
        # before the engine is built: what it decides (CPU threads, vLLM's CPU binding) is logged
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        built = build_engine(settings, device, FakeOptions(fake_ttft_ms, fake_itl_ms, fake_gate_file))
    except ValidationError as err:
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "settings"
            typer.echo(f"llmfleet worker: {where}: {str(e['msg']).removeprefix('Value error, ')}", err=True)
        raise typer.Exit(2) from None
    except ValueError as err:
        typer.echo(f"llmfleet worker: {err}", err=True)
        raise typer.Exit(2) from None
    if settings.drain_token is None:
        logging.getLogger(__name__).warning("no drain token configured: POST /drain is disabled (SIGTERM drains)")
    if built.max_bytes_per_token is None:
        logging.getLogger(__name__).warning(
            "no bound on bytes per token for this tokenizer: prompts are measured "
            "by tokenizing them (bounded by --max-body-bytes)"
        )
    server = WorkerServer(
        built.engine,
        settings,
        log_level=log_level.lower(),
        max_bytes_per_token=built.max_bytes_per_token,
        freeze_heap_after_load=True,  # this process serves one model: see worker.heap
    )
    raise typer.Exit(server.run())
