#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has none): the `gpu`-marked exactness tests, then bench/lora.py
# (multi-LoRA vs the base alone vs one engine per adapter) on random weights in real models' shapes, since such a
# machine may hold neither the bundled model nor a hub. Logs and each bench's JSON go to $1 (default gpu-out/).
#
#   bash bench/gpu_checks.sh OUT_DIR        # python3 must hold torch with CUDA and the project's imports
set -u -o pipefail
out=${1:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/worker_image:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
timeout 300 python3 -m pytest -m gpu tests/worker_model/test_model_cuda.py -q -p no:cacheprovider -W ignore 2>&1 |
    tee "$out/pytest.log" | tail -15
for case in "smollm2-135m bfloat16" "llama-3.2-1b bfloat16" "smollm2-135m float32"; do
    set -- $case
    echo "== bench/lora.py --device cuda --random-weights $1 --dtype $2"
    timeout 300 python3 bench/lora.py --device cuda --random-weights "$1" --dtype "$2" 2>"$out/lora-$1-$2.err" |
        tee "$out/lora-$1-$2.log" | tail -6
done
