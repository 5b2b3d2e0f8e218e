"""Model versions whose files are built on the machine instead of kept in git.

A version folder holding an ``lm-build.toml`` (the shipped ``tiny-llama`` and
``tiny-gpt2``) is a small causal LM that ``ferry.lm_build`` writes from the
values in that file: an architecture, a seed and the dimensions. Its files are
megabytes of random weights, so git keeps the recipe and every machine builds
the same bytes from it, in seconds, the first time it serves the model
(``ferry up``) or when asked (``ferry models build``).

A build leaves a stamp in the folder naming the values it was built from
(written before the files are moved in, completed after). The folder counts
as built when every file ``build_lm`` writes is there and the stamp names
this recipe's values: a folder built from other values, or left half-moved,
is built again. A folder holding files but no stamp (a real model's, put in
its place) is not Ferry's to replace: it is served as it is.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.models.repository import relative
from ferry.lm_build import Shape, build_shape, shape_for

RECIPE = "lm-build.toml"
# What build_lm writes.
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
INTEGERS = ("seed", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab_size")
FIELDS = ("arch", "dtype", "context_tokens", *INTEGERS)
_LOCK = ".lm-build.lock"
STAMP = ".lm-build.stamp"
_BUILDING = "building\n"
_SCRATCH = ".lm-build-"


class RecipeError(ValueError):
    """An lm-build.toml that cannot be built from; the message names the file and field."""


@dataclass(frozen=True)
class BuiltVersion:
    """One version folder built from its lm-build.toml."""

    model: str
    number: int
    folder: Path
    shape: Shape
    seed: int

    @property
    def recipe(self) -> Path:
        return self.folder / RECIPE

    def missing(self) -> list[str]:
        """The files build_lm writes that the folder lacks."""
        return [name for name in FILES if not (self.folder / name).is_file()]

    @property
    def signature(self) -> str:
        """The values the files are built from, as the stamp records them."""
        return f"{self.shape.flags()} --seed {self.seed}\n"

    def build_files(self, dest: Path) -> Path:
        """The files of the recipe, built into ``dest`` (a new folder): build_lm's."""
        return build_shape(dest, self.shape, seed=self.seed)

    def stamp(self) -> str | None:
        path = self.folder / STAMP
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None

    def foreign(self) -> bool:
        """Whether the folder holds model files that no build of a recipe wrote."""
        return self.stamp() is None and len(self.missing()) < len(FILES)

    def unbuilt(self) -> str | None:
        """Why the folder must be built, or None when it needs no build (built, or foreign)."""
        missing = self.missing()
        stamp = self.stamp()
        if stamp is None:
            return "its files are not built yet" if len(missing) == len(FILES) else None
        if stamp != self.signature:
            if stamp == _BUILDING:
                return "its last build did not finish"
            return f"its files were built from other values than {RECIPE}'s"
        if missing:
            return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
        return None


def read_recipe(model: str, folder: Path) -> BuiltVersion:
    """The version ``folder`` of ``model`` as its lm-build.toml describes it."""
    path = folder / RECIPE
    where = relative(folder.parent.parent, path)
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise RecipeError(f"{where}: is not valid TOML ({exc})") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise RecipeError(f"{where}: {unknown[0]}: is not a field ({', '.join(FIELDS)})")
    for key in ("arch", "seed"):
        if key not in data:
            raise RecipeError(f"{where}: {key}: is required")
    for key in (*INTEGERS, "context_tokens"):
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RecipeError(f"{where}: {key}: must be an integer, got {value!r}")
    values = {key: data[key] for key in FIELDS if key in data and key not in ("arch", "seed")}
    try:
        shape = shape_for(str(data["arch"]), **values)
    except (TypeError, ValueError) as exc:
        raise RecipeError(f"{where}: {exc}") from None
    return BuiltVersion(model, int(folder.name), folder, shape, int(data["seed"]))


def built_versions(root: Path, models: Iterable[str] | None = None) -> list[BuiltVersion]:
    """Every version under ``root`` built from a recipe (of ``models`` only, when given)."""
    wanted = None if models is None else set(models)
    found = []
    for recipe in sorted(root.glob(f"*/*/{RECIPE}")):
        folder = recipe.parent
        model = folder.parent.name
        if folder.name.isdigit() and (wanted is None or model in wanted):
            found.append(read_recipe(model, folder))
    return found


def build(version: BuiltVersion, force: bool = False) -> bool:
    """Build the version's files into its folder; False when it needs no build.

    Built beside the folder's files and moved in under a lock on the folder,
    so processes starting together build it once. ``force`` builds even a
    built folder, or one holding files of its own.
    """
    with _locked(version.folder):
        if not force and version.unbuilt() is None:
            return False
        # A build killed before it could clean up leaves its scratch folder.
        for leftover in version.folder.glob(f"{_SCRATCH}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        with tempfile.TemporaryDirectory(prefix=_SCRATCH, dir=version.folder) as scratch:
            built = version.build_files(Path(scratch) / "files")
            stamp = version.folder / STAMP
            stamp.write_text(_BUILDING)
            for path in built.iterdir():
                # The weights are written private; the repository is read by every process.
                path.chmod(0o644)
                os.replace(path, version.folder / path.name)
            stamp.write_text(version.signature)
    return True


def build_missing(root: Path, models: Iterable[str], say: Callable[[str], None]) -> bool:
    """Build what the served ``models`` lack, one line each; False (said why) if one cannot."""
    try:
        versions = built_versions(root, models)
    except RecipeError as exc:
        say(f"error: {exc}")
        return False
    for version in versions:
        if version.unbuilt() is None:
            continue
        started_s = time.perf_counter()
        try:
            build(version)
        except (OSError, ValueError) as exc:
            say(f"error: cannot build {version.model} version {version.number} ({exc})")
            return False
        say(
            f"built {version.model} version {version.number} in "
            f"{time.perf_counter() - started_s:.1f} s: a {version.shape.arch}-shaped model "
            f"with random weights, so the text it generates is noise"
        )
    return True


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with (folder / _LOCK).open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
