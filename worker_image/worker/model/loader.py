"""Read an HF safetensors folder (single file or sharded with an index) into a name -> tensor mapping.

Kept apart from the model code so the model never touches the file system and tests can hand it weights
directly. Tensors are converted to the requested dtype as they are read, one at a time, so peak memory stays
near the size of the converted model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a model folder, in a stable order."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / n for n in names]
    elif (root / SINGLE_FILE).is_file():
        files = [root / SINGLE_FILE]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {root}: the builtin engine loads HF safetensors folders "
            "(convert .bin/.gguf checkpoints first, e.g. `llmfleet model pull`)"
        )
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"weight shards listed in {index} are missing: {[str(m) for m in missing]}")
    return files


def load_weights(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of the folder, floating ones converted to `dtype`."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safetensors' handle is not a dict: keys() is its API
                t = f.get_tensor(name)
                out[name] = t.to(dtype) if t.is_floating_point() else t
    return out
