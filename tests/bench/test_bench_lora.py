"""`bench/lora.py` serves the same tokens in every system it compares, and its random-weights shapes are the real
models' shapes, so a run on a machine without the bundled model (a GPU machine) measures the same workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lora import SHAPES
from safetensors import safe_open
from worker.model.testing import make_tiny_llama

BENCH = Path(__file__).resolve().parents[2] / "bench" / "lora.py"


def test_every_system_generates_the_same_tokens(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "m", num_hidden_layers=2)
    run = subprocess.run(
        [sys.executable, str(BENCH), "--model", str(model), "--quick", "--requests", "8", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(run.stdout.strip().splitlines()[-1])
    systems = {s["system"]: s for s in report["systems"]}
    assert set(systems) == {"base", "multi_lora", "per_adapter"}
    assert len({s["tokens"] for s in systems.values()}) == 1 and systems["base"]["tokens"] > 0
    assert systems["multi_lora"]["adapter_loads"] == 8
    # one engine per adapter runs its requests apart, so it takes more steps than one engine for all of them
    assert systems["per_adapter"]["steps"] > systems["multi_lora"]["steps"] > 0
    assert report["device"] == "cpu" and report["model"] == str(model)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_random_weights_take_the_real_shape(tmp_path: Path, shape: str) -> None:
    want = SHAPES[shape]
    small = want | {"num_hidden_layers": 1, "intermediate_size": 8}  # the shape that matters here, cheaply
    folder = make_tiny_llama(tmp_path, init_std=0.02, **small)
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == want["pad_vocab_to"]
    assert config["hidden_size"] == want["hidden_size"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        embedding = f.get_slice("model.embed_tokens.weight").get_shape()
        names = set(f.keys())
    assert list(embedding) == [want["pad_vocab_to"], want["hidden_size"]]
    assert ("lm_head.weight" in names) == (not want["tie_word_embeddings"])
