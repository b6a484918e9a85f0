"""The spec of an InferenceDeployment: the model, the engine, the variants and their sizes, the rollout and the
drain; the worker pod template is `crds.podtemplate`.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from crds.base import (
    ADAPTER_NAME_PATTERN,
    ADAPTER_SOURCE_PATTERN,
    DNS_LABEL_PATTERN,
    MODEL_NAME_PATTERN,
    MODEL_SOURCE_PATTERN,
    DnsLabel,
    FreeForm,
    Quantity,
    SpecModel,
    list_map,
)
from crds.podtemplate import PodTemplate


class Engine(StrEnum):
    """Inference engine run in the worker pods."""

    BUILTIN = "builtin"
    VLLM = "vllm"


class Quantization(StrEnum):
    """Weight quantization of a variant."""

    NONE = "none"
    INT8 = "int8"
    FP8 = "fp8"
    INT4 = "int4"


class DType(StrEnum):
    """Activation/weight compute dtype; `auto` lets the engine choose (bfloat16 where supported)."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class ModelSpec(SpecModel):
    """The model served, and where its weights come from."""

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=MODEL_NAME_PATTERN,
        description="Served model name: the `model` field clients send (e.g. `smollm2`, `llama-3-8b`). "
        "Letters, digits, '.', '_', '/', '-'; no ':' (the gateway reads `NAME:VARIANT` as a request for one variant).",
    )
    source: str = Field(
        max_length=512,
        pattern=MODEL_SOURCE_PATTERN,
        description="Where the weights come from: `bundled://smollm2-135m-instruct` (shipped with the worker image), "
        "`hf://ORG/REPO` (downloaded from a model hub; the cluster must reach one), `pvc://CLAIM/PATH` "
        "(a PersistentVolumeClaim mounted read-only) or an absolute path already present on the node.",
    )
    revision: str | None = Field(
        None, min_length=1, max_length=128, description="Hub revision (branch, tag or commit) for `hf://` sources."
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=1_048_576,
        description="Longest sequence (prompt + output tokens) served; unset means the model's own limit.",
    )


class SpeculativeMethod(StrEnum):
    """How draft tokens are proposed."""

    NGRAM = "ngram"


class SpeculativeSpec(SpecModel):
    """Speculative decoding by prompt lookup: draft tokens copied from earlier in the context, verified by the model
    in one forward pass. Greedy output is unchanged and sampling keeps its distribution; it pays off when outputs
    copy from the prompt (RAG answers, code edits, summaries, "repeat this passage")."""

    method: SpeculativeMethod = Field(
        SpeculativeMethod.NGRAM,
        strict=False,
        description="`ngram`: prompt lookup (the only method; it needs no draft model).",
    )
    num_tokens: int = Field(
        4,
        ge=1,
        le=16,
        description="Draft tokens proposed per step and request (vLLM's `num_speculative_tokens`).",
    )
    prompt_lookup_max: int = Field(
        4, ge=1, le=32, description="Longest n-gram at the end of the context looked up earlier in it."
    )
    prompt_lookup_min: int = Field(2, ge=1, le=32, description="Shortest such n-gram; at most `promptLookupMax`.")
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Builtin engine: speculate only in steps where at most this many requests decode (large "
        "batches are compute-bound, where rejected drafts cost throughput); unset means the engine default (4). "
        "vLLM has no such knob and ignores it.",
    )


# The ranks vLLM 0.32 accepts as `max_lora_rank` (`vllm.config.lora.MaxLoRARanks`); the worker checks the same set
# (`worker.server.settings.VLLM_MAX_LORA_RANKS`; tests/controllers/test_pods_worker_contract.py keeps them equal).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraSpec(SpecModel):
    """LoRA adapter serving in the worker pods (`--enable-lora`). A pod field: turning it on, off or resizing it
    rolls the pods (once); adding and removing `spec.adapters` afterwards never does."""

    max_loras: int = Field(
        4,
        ge=1,
        le=256,
        description="Adapters resident in one batch at once (slots; vLLM's `--max-loras`). More adapters than "
        "slots are served too: the least recently used one is swapped out.",
    )
    max_lora_rank: int = Field(
        16,
        ge=1,
        le=512,
        description="Largest adapter rank served (`--max-lora-rank`); an adapter of higher rank is refused "
        "(its condition says so) and the base keeps serving.",
    )


class EngineSpec(SpecModel):
    """The inference engine and its knobs; the same names map to both engines' flags."""

    type: Engine = Field(
        Engine.BUILTIN,
        strict=False,
        description="`builtin` (llmfleet's own paged-KV engine: CPU or CUDA) or `vllm` (vLLM's OpenAI server).",
    )
    dtype: DType = Field(DType.AUTO, strict=False, description="Compute dtype: auto, float32, bfloat16 or float16.")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Most sequences batched together in one step.")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=16,
        le=1_048_576,
        description="Token budget of one engine step (prefill chunks + decodes); unset means the engine default.",
    )
    kv_cache_bytes: Quantity | None = Field(
        None,
        description="Memory reserved for the paged KV cache per pod, as a quantity (e.g. `64Mi`, `8Gi`); unset means "
        "the engine sizes it from free memory.",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes.")
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts into chunks that share steps with decodes."
    )
    speculative: SpeculativeSpec | None = Field(
        None,
        description="Speculative decoding by prompt lookup (n-gram drafts); unset means off. Requests that ask "
        "for logprobs are decoded without it.",
    )
    lora: LoraSpec | None = Field(
        None,
        description="Serve LoRA adapters (`spec.adapters`) of the base model; unset means off. Needed by "
        "`spec.adapters`.",
    )
    extra_args: FreeForm = Field(
        default_factory=dict,
        description="Extra engine flags, free-form: key = flag name without leading dashes (e.g. "
        "`gpu-memory-utilization: 0.9`), `true` = bare flag. Flags that have a field here or that the operator "
        "sets itself (model, host, port, quantization, ...) are refused: use the field.",
    )


class AutoscalingTargets(SpecModel):
    """Per-replica targets; the autoscaler sizes the variant so that every set signal is at or below its target."""

    queue_depth_per_replica: float | None = Field(
        None, gt=0, le=10_000, description="Mean waiting requests per ready pod (`vllm:num_requests_waiting`)."
    )
    kv_cache_utilization: float | None = Field(
        None, gt=0, le=1, description="Mean KV-cache usage fraction per pod (`vllm:kv_cache_usage_perc`), 0..1."
    )
    ttft_p95_seconds: float | None = Field(
        None, gt=0, le=3600, description="95th percentile time to first token, seconds."
    )


class AutoscalingSpec(SpecModel):
    """Autoscaling of one variant on queue depth, KV-cache utilisation and TTFT."""

    min_replicas: int = Field(
        1, ge=0, le=1000, description="Fewest pods; 0 allows scale to zero (needs `scaleToZeroAfterSeconds`)."
    )
    max_replicas: int = Field(ge=1, le=1000, description="Most pods.")
    targets: AutoscalingTargets = Field(
        default_factory=AutoscalingTargets, description="Signals and their per-replica targets; set at least one."
    )
    tolerance: float = Field(
        0.1, ge=0, le=0.5, description="No change while every signal is within this fraction of its target."
    )
    scale_up_max_step: int = Field(4, ge=1, le=1000, description="Most pods added by one decision.")
    scale_down_stabilization_seconds: int = Field(
        120,
        ge=0,
        le=3600,
        description="Scale down only to the highest recommendation of this trailing window.",
    )
    scale_to_zero_after_seconds: int | None = Field(
        None,
        ge=10,
        le=86_400,
        description="Go to zero pods after this many seconds without requests (needs `minReplicas: 0`); the "
        "gateway holds requests meanwhile and wakes the variant.",
    )


class Resources(SpecModel):
    """Per-pod resources. They are requests; memory and GPUs are also the limits."""

    cpu: Quantity | None = Field(None, description="CPU request, e.g. `2` or `500m`.")
    memory: Quantity | None = Field(None, description="Memory request and limit, e.g. `2Gi`.")
    gpu: int = Field(0, ge=0, le=16, alias="nvidia.com/gpu", description="NVIDIA GPUs per pod (request = limit).")


class VariantSpec(SpecModel):
    """One way of serving the model (e.g. an fp8 and an int4 build); each variant has its own pods and size."""

    name: str = Field(
        min_length=1,
        max_length=32,
        pattern=DNS_LABEL_PATTERN,
        description="Variant name: lowercase letters, digits and '-' (used in pod names and labels).",
    )
    quantization: Quantization = Field(
        Quantization.NONE,
        strict=False,
        description="Weight quantization: `none`, `int8`, `fp8` or `int4`. `int8` is weight-only int8 with a "
        "scale per output channel: near-bf16 quality at fp8's memory. With `engine.type: vllm`, int8 and int4 need "
        "a pre-quantized checkpoint in this variant's `source`.",
    )
    source: str | None = Field(
        None,
        max_length=512,
        pattern=MODEL_SOURCE_PATTERN,
        description="Weights for this variant only (e.g. an AWQ/GPTQ int4 checkpoint); unset means `model.source`.",
    )
    weight: int = Field(
        1,
        ge=0,
        le=1000,
        description="Relative share of the requests that name no variant and no tier (share = weight / sum of "
        "weights), and of `spec.replicas`. 0 = reached only by tier or by `MODEL:VARIANT`.",
    )
    tiers: list[DnsLabel] = Field(
        default_factory=list,
        max_length=16,
        description="Request tiers this variant serves first (`x-llmfleet-tier` or the API key's tier); empty = none.",
    )
    resources: Resources = Field(default_factory=Resources, description="Per-pod CPU, memory and GPUs.")
    replicas: int | None = Field(
        None, ge=0, le=1000, description="Fixed pod count for this variant (instead of `autoscaling`)."
    )
    autoscaling: AutoscalingSpec | None = Field(None, description="Autoscale this variant (instead of `replicas`).")
    extra_args: FreeForm = Field(
        default_factory=dict, description="Engine flags for this variant only, laid over `engine.extraArgs`."
    )


class CanaryStep(SpecModel):
    """One step of a canary rollout."""

    weight: int = Field(ge=1, le=100, description="Percent of traffic (and of pods) on the canary during this step.")
    pause_seconds: int = Field(
        60, ge=0, le=86_400, description="How long the step holds while analysis runs before the next step."
    )


class AnalysisSpec(SpecModel):
    """Canary analysis: canary vs stable on LLM metrics, checked every `intervalSeconds`."""

    ttft_p95_max_ratio: float = Field(
        1.5, ge=1, le=100, description="Fail when canary TTFT p95 exceeds stable's by more than this factor."
    )
    itl_p95_max_ratio: float = Field(
        1.5, ge=1, le=100, description="Fail when canary inter-token latency p95 exceeds stable's by this factor."
    )
    error_rate_max: float = Field(
        0.01, ge=0, le=1, description="Fail when the canary's error rate (5xx and aborted streams) is above this."
    )
    quality_min_agreement: float = Field(
        0.9,
        ge=0,
        le=1,
        description="When the quantization changes: fail when the canary's top token matches the stable "
        "revision's greedy token at fewer than this fraction of positions (teacher-forced on stable's continuations "
        "of the probe prompts; see docs/canary.md).",
    )
    interval_seconds: int = Field(30, ge=5, le=3600, description="Seconds between analysis checks.")
    failure_limit: int = Field(2, ge=1, le=100, description="Consecutive failed checks that trigger a rollback.")
    min_requests: int = Field(
        10, ge=0, le=100_000, description="Fewer canary requests than this in an interval: inconclusive, not pass."
    )


class CanarySpec(SpecModel):
    """A canary rollout: the new revision takes traffic step by step while analysis compares it with stable."""

    steps: list[CanaryStep] = Field(
        min_length=1,
        max_length=20,
        description="Steps with strictly increasing weights in 1..100; promotion follows the last step.",
    )
    analysis: AnalysisSpec = Field(
        default_factory=AnalysisSpec, description="Thresholds that fail an analysis check, and how often checks run."
    )


class RolloutSpec(SpecModel):
    """How a change of the pod-relevant spec reaches the pods. Without it pods are replaced (drained) directly."""

    canary: CanarySpec = Field(description="Canary rollout with automated analysis and rollback.")


class DrainSpec(SpecModel):
    """Lame-duck draining of every pod that goes away."""

    timeout_seconds: int = Field(
        120, ge=0, le=3600, description="Longest wait for in-flight requests to finish before the pod is deleted."
    )
    termination_grace_period_seconds: int = Field(
        150, ge=1, le=7200, description="The pods' grace period; must exceed `timeoutSeconds`."
    )


class AdapterSpec(SpecModel):
    """A LoRA adapter of the base model (PEFT format: `adapter_config.json` + `adapter_model.safetensors`), served
    by every pod next to the base. The operator loads it into running pods (no restart) and lists where it is
    ready in `status.adapters`; clients select it with `model: MODEL:ADAPTER` or `model: ADAPTER`."""

    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=ADAPTER_NAME_PATTERN,
        description="Adapter name, as clients send it (`MODEL:NAME` or `NAME`): letters, digits, '.', '_', '-'. "
        "Must differ from the model's and the variants' names.",
    )
    source: str = Field(
        max_length=512,
        pattern=ADAPTER_SOURCE_PATTERN,
        description="Where the adapter comes from: an absolute folder path in the pods (e.g. on a volume of "
        "`template.volumes`), `file:///FOLDER`, or `hf://ORG/REPO[@REVISION]` (the cluster must reach a hub). "
        "Changing it reloads the adapter in place.",
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        le=1_000_000_000,
        description="Gateway limit on this adapter's tokens (prompt + max output, reserved at admission) per minute "
        "over all API keys, so one busy fine-tune cannot crowd out the base and the other adapters; unset means no "
        "limit beyond the keys' own. Over it, requests get 429 with Retry-After.",
    )


class InferenceDeploymentSpec(SpecModel):
    """Desired state of an InferenceDeployment: a model served by one or more variants of worker pods."""

    model: ModelSpec = Field(description="The served model and its weights.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Inference engine and its knobs.")
    variants: list[VariantSpec] = Field(
        min_length=1,
        max_length=16,
        description="Variants serving the model; at least one, names unique.",
        json_schema_extra=list_map("name"),
    )
    replicas: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Pods shared, by weight, by the variants that set neither `replicas` nor `autoscaling`; unset "
        "means one pod each. Written by `kubectl scale` (the scale subresource).",
    )
    rollout: RolloutSpec | None = Field(None, description="Canary rollout of spec changes; unset = direct replace.")
    drain: DrainSpec = Field(default_factory=DrainSpec, description="Draining of pods that go away.")
    template: PodTemplate = Field(default_factory=PodTemplate, description="Worker pod template.")
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=256,
        description="LoRA adapters served next to the base model (needs `engine.lora`). Adding, changing or "
        "removing one loads or unloads it in the running pods; no pod restarts.",
        json_schema_extra=list_map("name"),
    )
