"""What the api image runs needs none of the worker extra (pyproject.toml, Dockerfile).

The api image installs pyproject's base dependencies alone: no torch,
transformers or onnxruntime. Each process it runs is taken here as far as it
goes without Redis, in a fresh interpreter: the API's app and catalog for the
shipped models (a job's input checked and priced for each), the migrations,
the command line, the Celery app, Flower's command and the sim worker's loop.
This venv has the worker extra, so an import that slipped in would succeed
here: what counts is that none of those modules is loaded at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER_ONLY = ("torch", "transformers", "onnxruntime", "torchvision", "sentence_transformers")

PROBE = """
import base64, io, json, sys
from pathlib import Path

from PIL import Image

from api.app import create_app
from backends.catalog import build_catalog
from core.db import migrate
from core.config.settings import Settings
from ferry.cli import guard_flower_metrics, main
from workers.gpu.main import build_loop
from workers.tasks.app import create_celery

settings = Settings(
    redis_url="redis://127.0.0.1:9/0",  # never connected to: nothing here talks to Redis
    data_dir=Path(sys.argv[1]),
    models="minilm,resnet50,sim",
    model_parameters={"resnet50": {"random_weights": True}},
)
create_app(settings)
catalog = build_catalog(settings)
png = io.BytesIO()
Image.new("RGB", (32, 32)).save(png, "PNG")
costs = {
    "minilm": catalog["minilm"].validate("a text priced in tokens").cost,
    "resnet50": catalog["resnet50"].validate(base64.b64encode(png.getvalue()).decode()).cost,
    "sim": catalog["sim"].validate({"cost": 3}).cost,
}
migrate.upgrade(settings.sqlalchemy_url)
for args in (["--help"], ["jobs", "--help"], ["db", "--help"]):
    assert main(args) == 0, args
create_celery(settings)
guard_flower_metrics("a-token")
import flower.command  # what `ferry flower` starts

build_loop(settings, "sim")  # its device is simulated: no --device, as compose runs it
worker_only = sys.argv[2].split(",")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in worker_only)
print(json.dumps({"loaded": loaded, "costs": costs}))
"""


def test_the_api_images_processes_import_nothing_of_the_worker_extra(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path), ",".join(WORKER_ONLY)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    assert found["loaded"] == []
    # The checks ran: minilm's tokenizer counted tokens, the PNG header was read.
    assert found["costs"]["minilm"] > 1
    assert found["costs"]["resnet50"] > 0
    assert found["costs"]["sim"] == 3
