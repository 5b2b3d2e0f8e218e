"""Reading model.toml files: every problem noted with its file and field, none raised.

:func:`load_repository` reads a whole repository into core.models.repository's
types; the format is documented field by field in docs/model-repository.md.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from core.models.repository import (
    CostConfig,
    EmbeddingsConfig,
    InputConfig,
    ModelConfig,
    ModelVersion,
    Problem,
    Repository,
    TensorSpec,
    env_name,
    relative,
)

MODULE_NAME = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
INPUT_KINDS = ("text", "image", "json", "tensor", "generation")
COST_FUNCTIONS = ("tokens", "pixels", "field", "constant")
DEVICES = ("auto", "gpu", "cpu", "none")
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "bool")

# What each table of model.toml may hold besides its own keys (checked below);
# [batching] and [memory] take the scheduler's per-model settings by their
# names in core.config.settings, checked there.
TOP_LEVEL = {
    "name",
    "backend",
    "description",
    "active_version",
    "precision",
    "input",
    "cost",
    "batching",
    "memory",
    "instances",
    "parameters",
    "embeddings",
}
INPUT_KEYS = {
    "text": {"kind", "max_chars", "max_tokens", "overlength", "tokenizer"},
    "image": {"kind", "image_size", "max_image_bytes", "max_pixels"},
    "json": {"kind", "schema"},
    "tensor": {"kind", "tensors"},
    "generation": {
        "kind",
        "max_chars",
        "tokenizer",
        "context_tokens",
        "default_max_tokens",
        "chat_template",
    },
}
COST_KEYS = {"function", "field", "max", "value"}
INSTANCE_KEYS = {"device", "count"}
EMBEDDINGS_KEYS = {"dimensions", "truncatable"}
MEMORY_KEYS = {"memory_budget_bytes", "memory_threshold", "gpu_memory_fraction"}


def load_repository(
    root: Path,
    environ: Mapping[str, str] | None = None,
    known_settings: Iterable[str] = (),
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    only: str | None = None,
) -> Repository:
    """Read every model under ``root`` (or the one named ``only``); problems are collected.

    ``environ`` (default ``os.environ``) overrides [input] and [parameters]
    values: ``FERRY_<MODEL>_<KEY>`` (``FERRY_SIM_LATENCY_BASE_MS``), parsed as
    the type the file gives. ``overrides`` (FERRY_MODEL_PARAMETERS), per
    model, then replaces values by key, typed already. ``known_settings``:
    the names [batching] and [memory] may use (their values are checked by
    the settings themselves).
    """
    environ = os.environ if environ is None else environ
    problems: list[Problem] = []
    models: dict[str, ModelConfig] = {}
    root = Path(root)
    if not root.is_dir():
        problems.append(Problem(str(root), "", "is not a folder (FERRY_MODEL_REPOSITORY)"))
        return Repository(root, models, tuple(problems))
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if only is not None and folder.name != only:
            continue
        if folder.name == "__pycache__":
            continue
        config_file = folder / "model.toml"
        if not config_file.is_file():
            problems.append(
                Problem(
                    relative(root, folder), "", "has no model.toml (every model folder needs one)"
                )
            )
            continue
        reader = _Reader(
            root, config_file, environ, set(known_settings), (overrides or {}).get(folder.name, {})
        )
        model = reader.model(folder)
        problems += reader.problems
        if model is not None:
            models[model.name] = model
    unknown = set(overrides or {}) - {p.name for p in root.iterdir() if p.is_dir()}
    for name in sorted(unknown if only is None else set()):
        problems.append(
            Problem(
                relative(root, root / name),
                "",
                "FERRY_MODEL_PARAMETERS sets values for it, but the repository has no such model",
            )
        )
    if not models and not problems:
        problems.append(Problem(str(root), "", "holds no model folder"))
    return Repository(root, models, tuple(problems))


class _Reader:
    """Reads one model.toml, noting each problem with its file and field."""

    def __init__(
        self,
        root: Path,
        path: Path,
        environ: Mapping[str, str],
        known_settings: set[str],
        overrides: Mapping[str, Any],
    ) -> None:
        self.root = root
        self.overrides = overrides
        self.path = path
        self.file = relative(root, path)
        self.environ = environ
        self.known_settings = known_settings
        self.problems: list[Problem] = []

    def problem(self, field: str, message: str, file: str | None = None) -> None:
        self.problems.append(Problem(file or self.file, field, message))

    def model(self, folder: Path) -> ModelConfig | None:
        try:
            data = tomllib.loads(self.path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
            self.problem("", f"is not valid TOML ({exc})")
            return None
        for key in sorted(set(data) - TOP_LEVEL):
            self.problem(key, f"is not a field of model.toml ({', '.join(sorted(TOP_LEVEL))})")
        name = self.string(data, "name", default=folder.name)
        if name != folder.name:
            self.problem("name", f"is {name!r}, but the folder is {folder.name!r}; they must match")
        if not NAME_PATTERN.match(folder.name):
            self.problem(
                "name",
                f"{folder.name!r} is not a model name (lower-case letters, digits, '-' "
                "and '_', at most 63)",
            )
        backend = self.string(data, "backend", required=True)
        description = self.string(data, "description", default="")
        precision = data.get("precision")
        if precision is not None and precision not in ("fp32", "fp16", "bf16"):
            self.problem("precision", f"is {precision!r}; one of fp32, fp16, bf16")
            precision = None
        input_config = self.input(name, self.table(data, "input", required=True))
        cost = self.cost(self.table(data, "cost", required=True), input_config)
        settings = self.settings(data)
        device, count = self.instances(self.table(data, "instances"))
        embeddings = self.embeddings(data, input_config)
        parameters = self.overridden(name, "parameters", dict(self.table(data, "parameters")))
        declared = set(parameters) | set(self.table(data, "input"))
        for key in sorted(set(self.overrides) - declared):
            self.problem(
                f"parameters.{key}",
                "FERRY_MODEL_PARAMETERS sets it, but model.toml declares no such key in "
                "[input] or [parameters]",
            )
        versions = self.versions(folder)
        if input_config is not None and input_config.kind == "generation":
            self.generation_files(input_config, versions)
        active = data.get("active_version")
        if active is None:
            active = max(versions) if versions else 0
        elif isinstance(active, bool) or not isinstance(active, int):
            self.problem("active_version", f"must be an integer, got {active!r}")
            active = 0
        elif versions and active not in versions:
            self.problem(
                "active_version",
                f"is {active}, but there is no folder {folder.name}/{active} "
                f"(versions: {', '.join(map(str, sorted(versions)))})",
            )
        if not any(p.is_dir() and p.name.isdigit() for p in folder.iterdir()):
            self.problem(
                "", "has no version folder (a folder named 1, 2, ... beside it holds the files)"
            )
        if input_config is None or cost is None or not backend or self.problems:
            return None
        return ModelConfig(
            name=name,
            backend=backend,
            folder=folder,
            description=description,
            input=input_config,
            cost=cost,
            versions=versions,
            active_version=active,
            precision=precision,
            settings=settings,
            device=device,
            count=count,
            parameters=parameters,
            embeddings=embeddings,
        )

    # Plain fields.

    def string(
        self, data: Mapping[str, Any], key: str, required: bool = False, default: str = ""
    ) -> str:
        value = data.get(key)
        if value is None:
            if required:
                self.problem(key, "is missing")
            return default
        if not isinstance(value, str):
            self.problem(key, f"must be a string, got {_toml_type(value)}")
            return default
        return value

    def table(self, data: Mapping[str, Any], key: str, required: bool = False) -> dict[str, Any]:
        value = data.get(key)
        if value is None:
            if required:
                self.problem(key, f"is missing (a [{key}] table)")
            return {}
        if not isinstance(value, dict):
            self.problem(key, f"must be a table ([{key}]), got {_toml_type(value)}")
            return {}
        return value

    def integer(
        self, data: Mapping[str, Any], key: str, where: str, default: int, low: int = 1
    ) -> int:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.problem(f"{where}.{key}", f"must be an integer, got {_toml_type(value)}")
            return default
        if value < low:
            self.problem(f"{where}.{key}", f"must be at least {low}, got {value}")
            return default
        return value

    def overridden(self, model: str, where: str, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` with FERRY_<MODEL>_<KEY>, then FERRY_MODEL_PARAMETERS, applied.

        Only keys the file declares are overridden from the environment; an
        override by FERRY_MODEL_PARAMETERS must name a declared key too, so a
        typo is an error rather than a silent no-op.
        """
        for key, current in list(data.items()):
            raw = self.environ.get(env_name(model, key))
            if raw is None or isinstance(current, dict | list):
                continue
            try:
                data[key] = _parse_like(current, raw)
            except ValueError as exc:
                self.problem(f"{where}.{key}", f"{env_name(model, key)}={raw!r}: {exc}")
        for key, value in self.overrides.items():
            if key in data:
                data[key] = value
        return data

    # Tables.

    def input(self, model: str, data: dict[str, Any]) -> InputConfig | None:
        if not data:
            return None
        data = self.overridden(model, "input", dict(data))
        kind = data.get("kind")
        if kind not in INPUT_KINDS:
            self.problem("input.kind", f"is {kind!r}; one of {', '.join(INPUT_KINDS)}")
            return None
        for key in sorted(set(data) - INPUT_KEYS[kind]):
            allowed = ", ".join(sorted(INPUT_KEYS[kind]))
            self.problem(f"input.{key}", f"is not a field of {kind} inputs ({allowed})")
        if kind == "text":
            overlength = data.get("overlength", "truncate")
            if overlength not in ("truncate", "refuse"):
                self.problem("input.overlength", f"is {overlength!r}; truncate or refuse")
            max_tokens = data.get("max_tokens")
            if max_tokens is not None:
                max_tokens = self.integer(data, "max_tokens", "input", 512)
            tokenizer = data.get("tokenizer")
            if tokenizer is not None and not isinstance(tokenizer, str):
                self.problem("input.tokenizer", f"must be a file name, got {_toml_type(tokenizer)}")
                tokenizer = None
            return InputConfig(
                kind=kind,
                max_chars=self.integer(data, "max_chars", "input", 20_000),
                max_tokens=max_tokens,
                overlength=str(overlength),
                tokenizer=tokenizer,
            )
        if kind == "generation":
            return self.generation(data)
        if kind == "image":
            config = InputConfig(
                kind=kind,
                image_size=self.integer(data, "image_size", "input", 224, low=8),
                max_image_bytes=self.integer(data, "max_image_bytes", "input", 700 * 1024),
                max_pixels=self.integer(data, "max_pixels", "input", 40_000_000),
            )
            if config.max_pixels > 178_000_000:
                self.problem("input.max_pixels", "must be at most 178000000 (Pillow's own limit)")
            return config
        if kind == "json":
            schema = data.get("schema", {})
            if not isinstance(schema, dict):
                self.problem("input.schema", f"must be a table (a JSON Schema), got {schema!r}")
                return None
            problem = _schema_problem(schema)
            if problem:
                self.problem("input.schema", problem)
                return None
            return InputConfig(kind=kind, schema=schema)
        tensors = data.get("tensors")
        if not isinstance(tensors, list) or not tensors:
            self.problem(
                "input.tensors",
                "must list the input tensors ([[input.tensors]] name, shape, dtype)",
            )
            return None
        specs: list[TensorSpec] = []
        for i, tensor in enumerate(tensors):
            where = f"input.tensors[{i}]"
            if not isinstance(tensor, dict):
                self.problem(where, "must be a table with name, shape and dtype")
                continue
            name, shape, dtype = tensor.get("name"), tensor.get("shape"), tensor.get("dtype")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.:-]*", name):
                self.problem(f"{where}.name", f"must be a tensor name, got {name!r}")
                continue
            if (
                not isinstance(shape, list)
                or not shape
                or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape)
            ):
                self.problem(
                    f"{where}.shape",
                    f"must list one positive size per axis, the batch axis left out; got {shape!r}",
                )
                continue
            if math.prod(shape) > 16_777_216:
                self.problem(f"{where}.shape", "holds more than 16777216 values per input")
                continue
            if dtype not in TENSOR_DTYPES:
                self.problem(f"{where}.dtype", f"is {dtype!r}; one of {', '.join(TENSOR_DTYPES)}")
                continue
            specs.append(TensorSpec(name, tuple(shape), dtype))
        if len({s.name for s in specs}) != len(specs):
            self.problem("input.tensors", "names two tensors alike")
        if len(specs) != len(tensors):
            return None
        return InputConfig(kind=kind, tensors=tuple(specs))

    def generation(self, data: dict[str, Any]) -> InputConfig | None:
        """A generation [input]; the version files it needs are checked by generation_files."""
        tokenizer = data.get("tokenizer")
        if not isinstance(tokenizer, str) or not tokenizer:
            self.problem(
                "input.tokenizer",
                "must name the model's tokenizer.json: the prompt's tokens are counted with it",
            )
            return None
        template = data.get("chat_template")
        if template is not None and (not isinstance(template, str) or not template):
            self.problem(
                "input.chat_template",
                f"must be a file name (a tokenizer_config.json or a .jinja file), got "
                f"{_toml_type(template)}",
            )
            return None
        context = data.get("context_tokens")
        if context is not None:
            context = self.integer(data, "context_tokens", "input", 2048, low=2)
        return InputConfig(
            kind="generation",
            max_chars=self.integer(data, "max_chars", "input", 100_000),
            tokenizer=tokenizer,
            context_tokens=context,
            default_max_tokens=self.integer(data, "default_max_tokens", "input", 256),
            chat_template=template,
        )

    def generation_files(self, config: InputConfig, versions: Mapping[int, ModelVersion]) -> None:
        """Each version's context length (unless model.toml gives one) and chat template."""
        # Imported here: only a repository with a generation model needs Jinja.
        from core.models.generation import version_problems

        for number, version in sorted(versions.items()):
            for field, message in version_problems(config, version.files):
                self.problem(field, f"version {number}: {message}")

    def cost(self, data: dict[str, Any], input_config: InputConfig | None) -> CostConfig | None:
        if not data:
            return None
        for key in sorted(set(data) - COST_KEYS):
            self.problem(
                f"cost.{key}", f"is not a field of [cost] ({', '.join(sorted(COST_KEYS))})"
            )
        function = data.get("function")
        if function not in COST_FUNCTIONS:
            self.problem("cost.function", f"is {function!r}; one of {', '.join(COST_FUNCTIONS)}")
            return None
        kind = input_config.kind if input_config else None
        if kind == "generation" and function != "tokens":
            self.problem(
                "cost.function",
                f"is {function!r}; generation inputs are priced in 'tokens' (the prompt's "
                "and max_tokens: the KV cache a job reserves)",
            )
            return None
        needs = {"tokens": "text", "pixels": "image", "field": "json"}.get(function)
        if needs and kind and kind != needs and not (function == "tokens" and kind == "generation"):
            self.problem(
                "cost.function", f"{function!r} prices {needs} inputs; this model takes {kind}"
            )
            return None
        if function == "tokens" and input_config is not None and not input_config.tokenizer:
            self.problem("cost.function", "'tokens' needs input.tokenizer (a tokenizer.json)")
            return None
        if function == "field":
            member = data.get("field")
            if not isinstance(member, str) or not member:
                self.problem("cost.field", "must name the input's member that holds the cost")
                return None
            return CostConfig(
                function=function, field=member, max=self.integer(data, "max", "cost", 4096)
            )
        if function == "constant":
            return CostConfig(function=function, value=self.integer(data, "value", "cost", 1))
        return CostConfig(function=function)

    def settings(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """[batching] and [memory], and precision: scheduler settings for this model alone."""
        settings: dict[str, Any] = {}
        for table in ("batching", "memory"):
            for key, value in self.table(data, table).items():
                if key not in self.known_settings or (table == "memory") != (key in MEMORY_KEYS):
                    allowed = sorted(
                        MEMORY_KEYS
                        if table == "memory"
                        else self.known_settings - MEMORY_KEYS - {"precision"}
                    )
                    self.problem(
                        f"{table}.{key}",
                        f"is not a setting of [{table}] ({', '.join(allowed)})",
                    )
                    continue
                settings[key] = value
        if isinstance(data.get("precision"), str):
            settings["precision"] = data["precision"]
        return settings

    def embeddings(
        self, data: Mapping[str, Any], input_config: InputConfig | None
    ) -> EmbeddingsConfig | None:
        if "embeddings" not in data:
            return None
        table = self.table(data, "embeddings")
        for key in sorted(set(table) - EMBEDDINGS_KEYS):
            self.problem(
                f"embeddings.{key}", "is not a field of [embeddings] (dimensions, truncatable)"
            )
        if input_config is not None and input_config.kind != "text":
            self.problem("embeddings", f"needs a text [input]; this model's is {input_config.kind}")
        if "dimensions" not in table:
            self.problem("embeddings.dimensions", "is required: the length of every vector")
        dimensions = self.integer(table, "dimensions", "embeddings", 1)
        truncatable = table.get("truncatable", False)
        if not isinstance(truncatable, bool):
            self.problem("embeddings.truncatable", f"must be true or false, got {truncatable!r}")
            truncatable = False
        return EmbeddingsConfig(dimensions, truncatable)

    def instances(self, data: dict[str, Any]) -> tuple[str, int]:
        for key in sorted(set(data) - INSTANCE_KEYS):
            self.problem(f"instances.{key}", "is not a field of [instances] (count, device)")
        device = data.get("device", "auto")
        if device not in DEVICES:
            self.problem("instances.device", f"is {device!r}; one of {', '.join(DEVICES)}")
            device = "auto"
        return str(device), self.integer(data, "count", "instances", 1)

    def versions(self, folder: Path) -> dict[int, ModelVersion]:
        versions: dict[int, ModelVersion] = {}
        for path in sorted(folder.iterdir()):
            if not path.is_dir() or not (path.name.isascii() and path.name.isdigit()):
                continue
            number = int(path.name)
            if number < 1 or path.name != str(number):
                self.problem(
                    "",
                    "is not a version's name (versions are named 1, 2, 3 ...)",
                    relative(self.root, path),
                )
                continue
            files = self.version_files(path)
            if files is not None:
                versions[number] = ModelVersion(number, path, files)
        return versions

    def version_files(self, folder: Path) -> Path | None:
        """The version's own folder, or where its version.toml says its files are."""
        marker = folder / "version.toml"
        if not marker.is_file():
            return folder
        file = relative(self.root, marker)
        try:
            data = tomllib.loads(marker.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
            self.problem("", f"is not valid TOML ({exc})", file)
            return None
        unknown = sorted(set(data) - {"files", "package"})
        if unknown:
            self.problem(unknown[0], "is not a field of version.toml (files, package)", file)
        if ("files" in data) == ("package" in data):
            self.problem("", "needs exactly one of files (a folder) or package (a module)", file)
            return None
        if "files" in data:
            path = Path(str(data["files"])).expanduser()
            path = path if path.is_absolute() else (folder / path)
            if not path.is_dir():
                self.problem("files", f"{path} is not a folder", file)
                return None
            return path.resolve()
        package = data["package"]
        if not isinstance(package, str) or not re.fullmatch(
            r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", package
        ):
            self.problem("package", f"must be a module name, got {package!r}", file)
            return None
        try:
            module = importlib.import_module(package)
            # Weight packages name their files with get_model_path(); else the package's folder.
            getter = getattr(module, "get_model_path", None)
            if callable(getter):
                location = Path(str(getter()))
            elif getattr(module, "__file__", None):
                location = Path(str(module.__file__)).parent
            else:
                self.problem("package", f"{package!r} has no folder (a namespace package)", file)
                return None
        except Exception as exc:  # the package's own code runs here: any error is a problem
            self.problem("package", f"{package!r} cannot be imported ({exc})", file)
            return None
        if not location.is_dir():
            self.problem("package", f"{package!r} names {location}, which is not a folder", file)
            return None
        return location.resolve()


def _parse_like(current: Any, raw: str) -> Any:
    if isinstance(current, bool):
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError("must be true or false")
    if isinstance(current, int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError("must be an integer") from None
    if isinstance(current, float):
        try:
            return float(raw)
        except ValueError:
            raise ValueError("must be a number") from None
    return raw


def _schema_problem(schema: Mapping[str, Any]) -> str | None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return f"is not a valid JSON Schema ({exc.message})"
    return None


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__
