"""The ``python`` backend: a user's own class, named ``module:Class`` in model.toml.

The module is a ``.py`` file in the version's folder (or, failing that, the
model's folder), or else an importable module. The class follows
:class:`PythonModel`; nothing of it has to import Ferry::

    class Doubler:
        def __init__(self, files: Path, parameters: dict[str, Any], device: str) -> None:
            ...                       # load weights from ``files``
        def predict(self, inputs: list[Any]) -> list[Any]:
            return [2 * x for x in inputs]   # one JSON value per input, in order

Optional attributes tell the scheduler more: ``padded`` (a batch costs
``n x max cost``), ``declared_memory() -> (base_bytes, bytes_per_cost)``.
The example in examples/models/text-stats is one such model.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from backends.base import HostRuntime, RuntimeOptions
from core.models.repository import ModelConfig, ModelVersion, Problem


class PythonModel(Protocol):
    """What a ``python`` model's class offers: built once per worker, then batches."""

    def __init__(self, files: Path, parameters: dict[str, Any], device: str) -> None: ...

    def predict(self, inputs: list[Any]) -> list[Any]:
        """One JSON-serialisable output per input, in order; raise to fail the batch."""
        ...


class PythonBackend:
    name = "python"
    input_kinds = frozenset({"text", "image", "json", "tensor"})
    uses_device = True

    def check(self, model: ModelConfig, version: ModelVersion) -> list[Problem]:
        # Every other parameter is the class's own, handed to it as they are.
        problems = []
        target = model.parameters.get("class")
        if not isinstance(target, str):
            message = "is missing" if target is None else "must be a string ('module:Class')"
            return [Problem(model.where(), "parameters.class", message)]
        module, _, attribute = target.partition(":")
        if not module or not attribute or not attribute.isidentifier():
            problems.append(
                Problem(
                    model.where(),
                    "parameters.class",
                    f"{target!r} is not 'module:Class' (a .py file beside the version, or an "
                    "importable module, and the class in it)",
                )
            )
        elif (path := module_file(model, version, module)) is not None:
            problem = class_problem(path, attribute)
            if problem:
                problems.append(Problem(model.where(path), "", problem))
        elif not _importable(module):
            problems.append(
                Problem(
                    model.where(version.folder),
                    "",
                    f"{module}.py is missing (parameters.class names it), and no module "
                    f"{module!r} can be imported",
                )
            )
        return problems

    def runtime(
        self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions
    ) -> PythonRuntime:
        return PythonRuntime(model, version, options)


BACKENDS = {"python": PythonBackend()}


def module_file(model: ModelConfig, version: ModelVersion, module: str) -> Path | None:
    """The ``module``'s file in the version's folder or else the model's, if there is one."""
    relative = Path(*module.split(".")).with_suffix(".py")
    for folder in (version.files, version.folder, model.folder):
        if (folder / relative).is_file():
            return folder / relative
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def class_problem(path: Path, name: str) -> str | None:
    """Why ``path`` does not define class ``name`` (read, never run: the API runs no user code)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as exc:
        return f"cannot be read as Python ({exc})"
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return None
        if isinstance(node, ast.Assign | ast.ImportFrom) and name in _bound_names(node):
            return None  # bound another way (an alias, an import): found when loaded
    return f"defines no class {name!r} (parameters.class names it)"


def _bound_names(node: ast.Assign | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.ImportFrom):
        return {alias.asname or alias.name for alias in node.names}
    return {t.id for t in node.targets if isinstance(t, ast.Name)}


def load_class(model: ModelConfig, version: ModelVersion) -> Any:
    """The class ``parameters.class`` names, its module loaded afresh for this version."""
    module_name, _, attribute = str(model.parameters["class"]).partition(":")
    path = module_file(model, version, module_name)
    if path is None:
        module = importlib.import_module(module_name)
    else:
        # A name of its own per file, so two versions' modules never share sys.modules.
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        unique = f"ferry_model_{model.name.replace('-', '_')}_v{version.number}_{digest}"
        spec = importlib.util.spec_from_file_location(unique, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} cannot be loaded as a module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[unique] = module
        folder = str(path.parent)
        before = set(sys.modules)
        # Its own folder first on the path while it loads, so `import helpers` finds
        # the helpers beside it; then the modules it took from there are forgotten,
        # so that another version's `import helpers` finds its own.
        sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[unique]
            raise
        finally:
            sys.path.remove(folder)
            for name in set(sys.modules) - before:
                origin = getattr(sys.modules[name], "__file__", None) or ""
                if origin.startswith(folder + os.sep):
                    del sys.modules[name]
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise ImportError(f"{module_name} has no {attribute!r}") from None


class PythonRuntime(HostRuntime):
    """Runs a user's class: ``predict`` is the whole batch, on the worker's thread."""

    def __init__(self, model: ModelConfig, version: ModelVersion, options: RuntimeOptions) -> None:
        self.model = model
        self.version = version
        self.name = model.name
        self.device = options.device
        self.budget_bytes = options.budget_bytes
        self._instance: Any = None

    def load(self) -> None:
        cls = load_class(self.model, self.version)
        parameters = {k: v for k, v in self.model.parameters.items() if k != "class"}
        self._instance = cls(self.version.files, parameters, self.device)
        self.padded = bool(getattr(self._instance, "padded", False))

    def compute(self, prepared: list[Any]) -> list[Any]:
        outputs = self._instance.predict(prepared)
        return list(outputs)

    def declared_memory(self) -> tuple[float, float]:
        declared = getattr(self._instance, "declared_memory", None)
        if callable(declared):
            base, per_cost = declared()
            return float(base), float(per_cost)
        return 0.0, 0.0
