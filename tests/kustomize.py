"""The part of Kustomize that deploy/kubernetes uses, to build its overlays in tests.

No kustomize or kubectl binary is needed (nor can one be downloaded here), so
the tests build the overlays with this: resources (files and directories),
namespace, labels (without selectors), images, patches (strategic merge and
JSON 6902, with or without a target), and configMapGenerator and
secretGenerator without name hashes. Anything else in a kustomization, a
patch directive or a JSON patch operation it does not implement raises
KustomizeError: a manifest this builder cannot read is refused, never built
differently from what `kubectl apply -k` would apply; tests/unit/test_kubernetes.py
compares the two (kubectl comes with the dev dependencies).
"""

from __future__ import annotations

import base64
import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]

KUSTOMIZATION_FIELDS = frozenset(
    {
        "apiVersion", "kind", "resources", "namespace", "labels", "images", "patches",
        "configMapGenerator", "secretGenerator", "generatorOptions",
    }
)  # fmt: skip
GENERATOR_FIELDS = frozenset({"name", "behavior", "literals", "envs", "files"})
PATCH_FIELDS = frozenset({"path", "patch", "target"})
TARGET_FIELDS = frozenset({"group", "version", "kind", "name", "namespace", "labelSelector"})
IMAGE_FIELDS = frozenset({"name", "newName", "newTag", "digest"})
LABEL_FIELDS = frozenset({"pairs", "includeSelectors", "includeTemplates"})
# Kinds without a namespace (the ones these manifests could hold).
CLUSTER_SCOPED = frozenset(
    {
        "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
        "PersistentVolume", "PriorityClass", "StorageClass",
    }
)  # fmt: skip
# Kinds whose pod template labels: {includeTemplates: true} reaches.
TEMPLATED = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"})
# Strategic merge: the lists of Kubernetes' own kinds merged by a key rather
# than replaced (x-kubernetes-patch-merge-key); a custom resource's lists are
# always replaced, as Kustomize has no schema for them.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
BUILTIN_GROUPS = frozenset(
    {"", "apps", "batch", "autoscaling", "policy", "networking.k8s.io", "rbac.authorization.k8s.io"}
)


class KustomizeError(Exception):
    """A kustomization this builder cannot build (or that Kustomize would refuse)."""


def build(directory: Path) -> list[Object]:
    """The objects `kubectl kustomize directory` prints (in the order resources list them)."""
    directory = directory.resolve()
    config = _kustomization(directory)
    objects: list[Object] = []
    for entry in config.get("resources", []):
        path = directory / entry
        found = build(path) if path.is_dir() else _documents(path)
        for obj in found:
            if any(_same(obj, other) for other in objects):
                raise KustomizeError(f"{directory}: {_id(obj)} is listed twice")
            objects.append(obj)
    options = config.get("generatorOptions", {})
    hashed = options.get("disableNameSuffixHash") is not True
    if set(options) - {"disableNameSuffixHash"} or (
        hashed and (config.get("configMapGenerator") or config.get("secretGenerator"))
    ):
        # Names with a content hash would need every reference to them rewritten.
        raise KustomizeError(
            f"{directory}: generators need generatorOptions: {{disableNameSuffixHash: true}} only"
        )
    for kind, field in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for spec in config.get(field, []):
            _generate(directory, kind, spec, objects)
    for spec in config.get("patches", []):
        _patch(directory, spec, objects)
    if "namespace" in config:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = config["namespace"]
    for spec in config.get("labels", []):
        _label(directory, spec, objects)
    for spec in config.get("images", []):
        _retag(directory, spec, objects)
    return objects


def _kustomization(directory: Path) -> dict[str, Any]:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    config = yaml.safe_load(path.read_text()) or {}
    unknown = set(config) - KUSTOMIZATION_FIELDS
    if unknown:
        raise KustomizeError(f"{path}: this builder does not implement {sorted(unknown)}")
    if (
        config.get("apiVersion", "kustomize.config.k8s.io/v1beta1")
        != ("kustomize.config.k8s.io/v1beta1")
        or config.get("kind", "Kustomization") != "Kustomization"
    ):
        raise KustomizeError(f"{path}: not a kustomize.config.k8s.io/v1beta1 Kustomization")
    return dict(config)


def _documents(path: Path) -> list[Object]:
    if not path.is_file():
        raise KustomizeError(f"{path}: no such resource")
    found = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for doc in found:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
            raise KustomizeError(f"{path}: a document that is not a Kubernetes object")
    return found


def _id(obj: Object) -> str:
    return f"{obj['kind']}/{obj['metadata'].get('name')}"


def _same(a: Object, b: Object) -> bool:
    return _group(a) == _group(b) and _id(a) == _id(b)


def _group(obj: Object) -> str:
    api_version = str(obj["apiVersion"])
    return api_version.rpartition("/")[0]


def _generate(directory: Path, kind: str, spec: dict[str, Any], objects: list[Object]) -> None:
    unknown = set(spec) - GENERATOR_FIELDS
    if unknown:
        raise KustomizeError(f"{directory}: {kind} generator fields {sorted(unknown)}")
    data: dict[str, str] = {}
    for literal in spec.get("literals", []):
        key, sep, value = str(literal).partition("=")
        if not sep:
            raise KustomizeError(f"{directory}: literal {literal!r} has no '='")
        data[key] = value
    for name in spec.get("envs", []):
        data.update(_env_file(directory / name))
    for entry in spec.get("files", []):
        key, sep, name = str(entry).partition("=")
        path = directory / (name if sep else key)
        data[key if sep else path.name] = path.read_text()
    behavior = spec.get("behavior", "create")
    existing = [
        obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == spec["name"]
    ]
    if behavior == "create":
        if existing:
            raise KustomizeError(f"{directory}: {kind}/{spec['name']} exists: use behavior merge")
        obj: Object = {"apiVersion": "v1", "kind": kind, "metadata": {"name": spec["name"]}}
        if kind == "Secret":
            obj["type"] = "Opaque"
        obj["data"] = {}
        objects.append(obj)
    elif behavior in ("merge", "replace"):
        if len(existing) != 1:
            raise KustomizeError(f"{directory}: no {kind}/{spec['name']} to {behavior}")
        (obj,) = existing
        if behavior == "replace":
            obj["data"] = {}
        obj.setdefault("data", {})
    else:
        raise KustomizeError(f"{directory}: generator behavior {behavior!r}")
    for key, value in data.items():
        obj["data"][key] = base64.b64encode(value.encode()).decode() if kind == "Secret" else value


def _env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments skipped."""
    if not path.is_file():
        raise KustomizeError(f"{path}: no such env file")
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        key, sep, value = text.partition("=")
        if not sep:
            raise KustomizeError(f"{path}:{number}: not KEY=VALUE")
        values[key] = value
    return values


def _patch(directory: Path, spec: dict[str, Any], objects: list[Object]) -> None:
    unknown = set(spec) - PATCH_FIELDS
    if unknown or ("path" in spec) == ("patch" in spec):
        raise KustomizeError(f"{directory}: a patch needs one of path and patch, and only target")
    text = (directory / spec["path"]).read_text() if "path" in spec else spec["patch"]
    documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    target = spec.get("target")
    if len(documents) == 1 and isinstance(documents[0], list):
        if target is None:
            raise KustomizeError(f"{directory}: a JSON 6902 patch needs a target")
        for obj in _select(directory, target, objects):
            for operation in documents[0]:
                _json_patch(obj, operation)
        return
    # Strategic merge: one patch per document, each for its own object unless
    # a target names the objects.
    for content in documents:
        if not isinstance(content, dict):
            raise KustomizeError(f"{directory}: a patch that is neither a list nor an object")
        chosen = target or {"kind": content["kind"], "name": content["metadata"]["name"]}
        patch = {k: v for k, v in content.items() if k not in ("apiVersion", "kind", "metadata")}
        extra = {k: v for k, v in content["metadata"].items() if k not in ("name", "namespace")}
        if extra:
            patch["metadata"] = extra
        for obj in _select(directory, chosen, objects):
            _merge(obj, patch, _group(obj) in BUILTIN_GROUPS)


def _select(directory: Path, target: dict[str, Any], objects: list[Object]) -> list[Object]:
    unknown = set(target) - TARGET_FIELDS
    if unknown:
        raise KustomizeError(f"{directory}: patch target fields {sorted(unknown)}")
    selected = [obj for obj in objects if _matches(obj, target)]
    if not selected:
        raise KustomizeError(f"{directory}: patch target {target} matches nothing")
    return selected


def _matches(obj: Object, target: dict[str, Any]) -> bool:
    # Kustomize reads each field of a target as an anchored regular expression.
    group, _, version = str(obj["apiVersion"]).rpartition("/")
    fields = {
        "group": group,
        "version": version,
        "kind": obj["kind"],
        "name": obj["metadata"].get("name", ""),
        "namespace": obj["metadata"].get("namespace", ""),
    }
    for name, value in fields.items():
        if name in target and not re.fullmatch(str(target[name]), value):
            return False
    if "labelSelector" in target:
        labels = obj["metadata"].get("labels") or {}
        for term in str(target["labelSelector"]).split(","):
            match = re.fullmatch(r"\s*([\w./-]+)\s*(!=|==|=)\s*([\w.-]*)\s*", term)
            if match is None:
                raise KustomizeError(f"label selector term {term!r} is not key=value or key!=value")
            key, operator, value = match.groups()
            if (labels.get(key) == value) != (operator != "!="):
                return False
    return True


def _merge(dest: dict[str, Any], patch: dict[str, Any], builtin: bool) -> None:
    """A strategic merge of ``patch`` into ``dest``, in place."""
    for key, value in patch.items():
        if key.startswith("$"):
            raise KustomizeError(f"strategic merge directive {key} is not implemented")
        if value is None:
            dest.pop(key, None)
        elif isinstance(value, dict) and isinstance(dest.get(key), dict):
            _merge(dest[key], value, builtin)
        elif isinstance(value, list) and isinstance(dest.get(key), list) and builtin:
            dest[key] = _merge_list(key, dest[key], value)
        else:
            dest[key] = copy.deepcopy(value)


def _merge_list(key: str, dest: list[Any], patch: list[Any]) -> list[Any]:
    merge_key = MERGE_KEYS.get(key)
    if key == "ports":
        merge_key = "containerPort" if any("containerPort" in p for p in dest + patch) else "port"
    if merge_key is None:
        return copy.deepcopy(patch)
    # As Kustomize orders them: the patch's items (merged into their match),
    # then the items the patch does not name.
    named = {item[merge_key] for item in patch}
    merged: list[Any] = []
    for item in patch:
        match = next((d for d in dest if d.get(merge_key) == item[merge_key]), None)
        if match is None:
            merged.append(copy.deepcopy(item))
        else:
            combined = copy.deepcopy(match)
            _merge(combined, item, True)
            merged.append(combined)
    merged.extend(copy.deepcopy(d) for d in dest if d.get(merge_key) not in named)
    return merged


def _json_patch(obj: Object, operation: dict[str, Any]) -> None:
    op, path = operation.get("op"), str(operation.get("path", ""))
    if op not in ("add", "replace", "remove"):
        raise KustomizeError(f"JSON patch operation {op!r} is not implemented")
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    if not parts:
        raise KustomizeError(f"JSON patch path {path!r}")
    parent: Any = obj
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent.get(part)
        if parent is None:
            raise KustomizeError(f"JSON patch path {path!r} does not exist in {_id(obj)}")
    last = parts[-1]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op == "add":
            parent.insert(index, copy.deepcopy(operation["value"]))
        elif index >= len(parent):
            raise KustomizeError(f"JSON patch path {path!r} does not exist in {_id(obj)}")
        elif op == "replace":
            parent[index] = copy.deepcopy(operation["value"])
        else:
            del parent[index]
        return
    if op != "add" and last not in parent:
        raise KustomizeError(f"JSON patch path {path!r} does not exist in {_id(obj)}")
    if op == "remove":
        del parent[last]
    else:
        parent[last] = copy.deepcopy(operation["value"])


def _label(directory: Path, spec: dict[str, Any], objects: list[Object]) -> None:
    unknown = set(spec) - LABEL_FIELDS
    if unknown or spec.get("includeSelectors"):
        # Selectors are immutable: labels that reach them are not supported here.
        raise KustomizeError(f"{directory}: labels with {sorted(unknown) or 'includeSelectors'}")
    pairs = {str(k): str(v) for k, v in spec["pairs"].items()}
    for obj in objects:
        obj["metadata"].setdefault("labels", {}).update(pairs)
        if spec.get("includeTemplates") and obj["kind"] in TEMPLATED:
            template = obj["spec"].setdefault("template", {})
            template.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def _retag(directory: Path, spec: dict[str, Any], objects: list[Object]) -> None:
    unknown = set(spec) - IMAGE_FIELDS
    if unknown or "name" not in spec:
        raise KustomizeError(f"{directory}: image fields {sorted(unknown)} (name required)")
    for obj in objects:
        for container in all_containers(obj):
            name, tag, digest = split_image(str(container.get("image", "")))
            if name != spec["name"]:
                continue
            name = spec.get("newName", name)
            if "digest" in spec:
                container["image"] = f"{name}@{spec['digest']}"
                continue
            tag = str(spec.get("newTag", tag or ""))
            suffix = f"@{digest}" if digest else ""
            container["image"] = f"{name}{':' + tag if tag else ''}{suffix}"


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """name, tag, digest: ``registry:5000/ferry:1.0`` is ('registry:5000/ferry', '1.0', None)."""
    rest, _, digest = image.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon + 1 :], digest or None
    return rest, None, digest or None


def all_containers(value: Any) -> Iterator[dict[str, Any]]:
    """Every item of a ``containers`` or ``initContainers`` list anywhere in an object: where
    Kustomize's images transformer looks, in a custom resource too (a KServe
    ServingRuntime's ``spec.containers``)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("containers", "initContainers") and isinstance(item, list):
                yield from (c for c in item if isinstance(c, dict))
            else:
                yield from all_containers(item)
    elif isinstance(value, list):
        for item in value:
            yield from all_containers(item)


def pod_containers(obj: Object) -> list[dict[str, Any]]:
    """Every container and init container of a workload's pod template."""
    spec = obj.get("spec", {})
    if obj["kind"] == "CronJob":
        spec = spec.get("jobTemplate", {}).get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]
