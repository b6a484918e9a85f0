"""Resolve a model `source` (as written in an InferenceDeployment) to a local HF model folder.

* `bundled://NAME` -> the converted bundled model (converted on first use, see `bundled.py`);
* `hf://ORG/REPO[@REVISION]` -> a Hugging Face Hub snapshot (config, tokenizer, safetensors only). Clusters
  with a hub use it; here no hub is reachable and the error says so and what to do instead;
* anything else (optionally `file://`) -> a local or volume-mounted folder, which must hold a `config.json`.

LoRA adapters name their source the same way, without `bundled://` (`resolve_adapter_source`); what the folder
holds is checked when the engine loads it (`worker.model.lora`).
"""

from __future__ import annotations

import re
from pathlib import Path

from worker.model.bundled import ensure_bundled

HF_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


class ModelSourceError(ValueError):
    """The source cannot be turned into a local model folder; the message says why and what to do."""


def resolve_model_source(source: str, *, cache_dir: str | Path | None = None, revision: str | None = None) -> Path:
    if not source:
        raise ModelSourceError("model source is empty: use bundled://NAME, hf://ORG/REPO or a local folder path")
    if source.startswith("bundled://"):
        name = source.removeprefix("bundled://").strip("/")
        try:
            return ensure_bundled(name, cache_dir)
        except (ValueError, FileNotFoundError) as exc:
            raise ModelSourceError(str(exc)) from exc
    if source.startswith("hf://"):
        return _hf_snapshot(source.removeprefix("hf://").strip("/"), cache_dir, revision)
    path = Path(source.removeprefix("file://")).expanduser()
    if not path.is_dir():
        raise ModelSourceError(
            f"model folder {path} does not exist (sources: bundled://NAME, hf://ORG/REPO, or a local folder)"
        )
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"{path} has no config.json: point the source at an HF model folder")
    return path


def resolve_adapter_source(source: str, *, cache_dir: str | Path | None = None) -> Path:
    """A LoRA adapter's source (a folder, `file://FOLDER` or `hf://ORG/REPO[@REVISION]`) as a local folder."""
    if not source:
        raise ModelSourceError("adapter source is empty: use a folder path or hf://ORG/REPO")
    if source.startswith("hf://"):
        return _hf_snapshot(source.removeprefix("hf://").strip("/"), cache_dir, None)
    if re.match(r"[A-Za-z][\w+.-]*://", source) and not source.startswith("file://"):
        raise ModelSourceError(f"adapter sources are a folder, file://FOLDER or hf://ORG/REPO, got {source!r}")
    return Path(source.removeprefix("file://")).expanduser()


def _hf_snapshot(spec: str, cache_dir: str | Path | None, revision: str | None) -> Path:
    repo, _, rev = spec.partition("@")
    if repo.count("/") != 1:
        raise ModelSourceError(f"hf:// sources look like hf://ORG/REPO[@REVISION], got hf://{spec}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelSourceError("hf:// sources need the huggingface_hub package: pip install huggingface_hub") from exc
    try:
        folder = snapshot_download(
            repo_id=repo,
            revision=rev or revision,
            allow_patterns=HF_PATTERNS,
            cache_dir=str(Path(cache_dir).expanduser() / "hf") if cache_dir else None,
            etag_timeout=10,
        )
    except Exception as exc:  # the hub client raises many types (network, auth, missing repo)
        raise ModelSourceError(
            f"could not fetch hf://{spec} from the Hugging Face Hub ({type(exc).__name__}: {exc}). If this "
            "cluster has no hub access, copy the model folder to a volume and use its path as the source, or use "
            "bundled://smollm2-135m-instruct"
        ) from exc
    return Path(folder)
