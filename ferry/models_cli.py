"""``ferry models``: the models the API serves, and the model repository behind them.

``ferry models`` (or ``list``) asks the running API what it serves: each
model's active version, backend, live workers and queued jobs. The other
commands read the repository itself.

``build-lm`` writes a small causal language model's folder (seeded random weights and a
byte-level BPE tokenizer, ``ferry.lm_build``) for the generation path's tests and benchmarks.

``check`` reads every model.toml and asks each model's backend about its
files and parameters, without loading a model: each problem names the file
and the field. It exits 1 on an error (a model that FERRY_MODELS serves, or
a model.toml that cannot be read), 0 when there are only warnings (files
missing from a model that is not served). A version built from a recipe
(``ferry.built_models``) whose files are missing is named with the command
that builds it.

``build`` writes the files of the versions built from a recipe (the shipped
``tiny-llama`` and ``tiny-gpt2``), which ``ferry up`` does by itself for the
models it serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ferry import lm_build
from ferry.console import Row, choice_option, print_json, show_table
from ferry.remote import ApiOption, JsonOption, KeyOption, connect, given, remember, reported

if TYPE_CHECKING:
    from core.models.repository import Problem

app = typer.Typer(help="the models the API serves, and the model repository")


@app.callback(invoke_without_command=True)
def _models(
    ctx: typer.Context, as_json: JsonOption = False, api: ApiOption = None, key: KeyOption = None
) -> int:
    remember(ctx, api, key, as_json)
    if ctx.invoked_subcommand is None:
        return list_served(ctx)
    return 0


@app.command("list", help="the models the API serves: version, backend, workers, queued jobs")
def list_served(
    ctx: typer.Context, as_json: JsonOption = False, api: ApiOption = None, key: KeyOption = None
) -> int:
    with reported(), connect(ctx, api, key) as client:
        models = client.models()
    if as_json or given(ctx).as_json:
        for model in models:
            print_json(model.model_dump(mode="json"))
        return 0
    rows = [(m.name, m.version, m.backend, m.workers, sum(m.queue_depth.values())) for m in models]
    show_table(("name", "version", "backend", "workers", "queue"), rows)
    return 0


@app.command(
    "check", help="check a repository (default FERRY_MODEL_REPOSITORY) without loading models"
)
def check_repository(
    path: Annotated[
        str | None, typer.Argument(metavar="PATH", help="a repository folder", show_default=False)
    ] = None,
    all_: Annotated[
        bool, typer.Option("--all", help="errors for every model, not only those served")
    ] = False,
) -> int:
    # The repository's modules only for the commands that read it: `ferry models` starts faster.
    from backends.catalog import check, repository_for
    from core.config.settings import get_settings

    settings = get_settings()
    if path is not None:
        settings = settings.model_copy(update={"model_repository": Path(path)})
    repository = repository_for(settings)
    # A folder named on the command line is checked whole unless FERRY_MODELS says otherwise.
    whole = all_ or (path is not None and "models" not in settings.model_fields_set)
    served = None if whole else settings.model_names
    problems = check(repository, served)
    report(problems)
    errors = [p for p in problems if not p.warning]
    recipes_read = say_unbuilt(repository.root, repository.models, served, path)
    for model in repository.models.values():
        if served is not None and model.name not in served:
            continue
        mark = "problems" if any(model.concerns(p) for p in errors) else "ok"
        versions = ", ".join(
            f"{n}{' (active)' if n == model.active_version else ''}" for n in sorted(model.versions)
        )
        print(f"{model.name:20} {model.backend:22} versions {versions:16} {mark}")
    if errors or not recipes_read:
        count = len(errors) + (not recipes_read)
        print(f"{count} problem(s) in {repository.root}: Ferry cannot serve it as it is")
        return 1
    print(f"{repository.root}: ready to serve")
    return 0


def report(problems: list[Problem]) -> None:
    for problem in problems:
        print(f"{'warning' if problem.warning else 'error'}: {problem}")


def say_unbuilt(
    root: Path, models: Iterable[str], served: list[str] | None, path: str | None
) -> bool:
    """Name each version built from a recipe that needs building, and the command that does.

    False when a served model's recipe cannot be read (printed as an error; a
    model not served gets a warning).
    """
    from core.models.repository import relative
    from ferry.built_models import RecipeError, built_versions

    read = True
    for model in models:
        try:
            versions = built_versions(root, [model])
        except RecipeError as exc:
            serious = served is None or model in served
            print(f"{'error' if serious else 'warning'}: {exc}")
            read = read and not serious
            continue
        for version in versions:
            why = version.unbuilt()
            if why is None:
                continue
            where = f" --repository {path}" if path is not None else ""
            # The backend's problems above say what is missing; this says how to build it.
            print(
                f"{version.model} version {version.number} is built from "
                f"{relative(root, version.recipe)}, and {why}: "
                f"`ferry models build {version.model}{where}` builds it in seconds "
                "(ferry up does so for the models it serves)"
            )
    return read


def _plain_repository(columns: Sequence[str], rows: Sequence[Row]) -> list[str]:
    """The columns this command has always printed."""
    return [
        f"{name:20} {backend:22} {kind:7} {active:>6}  {versions:10} {served}"
        for name, backend, kind, active, versions, served in [columns, *rows]
    ]


@app.command("repository", help="the repository's models, versions and active versions")
def repository_models() -> int:
    from backends.catalog import repository_for
    from core.config.settings import get_settings

    settings = get_settings()
    repository = repository_for(settings)
    served = set(settings.model_names)
    active = {name: model.active_version for name, model in repository.models.items()}
    try:  # an operator's activations, where the database can be reached
        from core.db.versions import active_version
        from ferry.keys_cli import database_session

        with database_session() as session:
            active = {n: active_version(session, m) for n, m in repository.models.items()}
    except Exception as exc:
        print(f"(activations not read: {str(exc).splitlines()[0][:200]})")
    rows = [
        (
            model.name,
            model.backend,
            model.input.kind,
            active[model.name],
            ",".join(map(str, sorted(model.versions))),
            "yes" if model.name in served else "no",
        )
        for model in repository.models.values()
    ]
    columns = ("model", "backend", "input", "active", "versions", "served")
    show_table(columns, rows, plain=_plain_repository)
    return 0


@app.command(
    "activate", help="make a version the active one (a rollback too): workers switch to it"
)
def activate_version(
    name: Annotated[str, typer.Argument(metavar="NAME", show_default=False)],
    version: Annotated[int, typer.Argument(metavar="VERSION", show_default=False)],
) -> int:
    from backends.catalog import model_problems, repository_for
    from core.config.settings import get_settings
    from core.db.versions import ActivationError, activate, active_version
    from ferry.keys_cli import database_session

    settings = get_settings()
    repository = repository_for(settings)
    model = repository.models.get(name)
    if model is None:
        print(f"error: the repository ({repository.root}) has no model {name!r}")
        return 1
    problems = model_problems(model, [version]) if version in model.versions else []
    if problems:
        report(problems)
        print(f"{name}@{version} is not activated: its files have problems")
        return 1
    with database_session() as session:
        previous = active_version(session, model)
        try:
            activate(session, model, version)
        except ActivationError as exc:
            print(f"error: {exc}")
            return 1
    print(
        f"{name}: version {version} is active (was {previous}); workers load it, "
        f"switch new batches to it and drop the old one within FERRY_MODEL_POLL_S "
        f"({settings.model_poll_s:g} s) plus its load time"
    )
    return 0


def _dimension(flag: str, help_: str) -> Any:
    return typer.Option(flag, min=1, show_default=False, help=help_)


@app.command(
    "build-lm", help="write a small causal LM folder: seeded random weights, a trained tokenizer"
)
def build_lm_folder(
    dest: Annotated[Path, typer.Argument(metavar="DEST", show_default=False)],
    arch: Annotated[
        str,
        choice_option(
            "--arch",
            "ARCH",
            lm_build.ARCHES,
            "gpt2 or llama (grouped-query attention, rotary positions, a chat template)",
        ),
    ],
    seed: Annotated[int, typer.Option("--seed", help="the weights' seed")] = 0,
    layers: Annotated[
        int, _dimension("--layers", f"transformer blocks (default {lm_build.LAYERS})")
    ] = lm_build.LAYERS,
    hidden: Annotated[
        int, _dimension("--hidden", f"hidden size (default {lm_build.HIDDEN})")
    ] = lm_build.HIDDEN,
    heads: Annotated[
        int, _dimension("--heads", f"attention heads (default {lm_build.HEADS})")
    ] = lm_build.HEADS,
    kv_heads: Annotated[
        int | None, _dimension("--kv-heads", "key/value heads (llama; default heads / 2)")
    ] = None,
    intermediate: Annotated[
        int | None,
        _dimension("--intermediate", "MLP size (default 4 x hidden, llama 8/3 x hidden)"),
    ] = None,
    vocab_size: Annotated[
        int, _dimension("--vocab-size", f"tokens (default {lm_build.VOCAB_SIZE})")
    ] = lm_build.VOCAB_SIZE,
    context_tokens: Annotated[
        int, _dimension("--context-tokens", f"positions (default {lm_build.CONTEXT_TOKENS})")
    ] = lm_build.CONTEXT_TOKENS,
    dtype: Annotated[
        str,
        choice_option(
            "--dtype",
            "DTYPE",
            lm_build.DTYPES,
            "the weights' type: float32 (default), bfloat16 or float16",
        ),
    ] = "float32",
    force: Annotated[bool, typer.Option("--force", help="replace a non-empty DEST")] = False,
) -> int:
    import time

    from transformers.utils import logging as transformers_logging

    from ferry.lm_build import build_lm, parameter_count

    transformers_logging.disable_progress_bar()  # one line per file instead
    started_s = time.perf_counter()
    try:
        folder = build_lm(
            dest,
            arch,
            seed=seed,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            intermediate=intermediate,
            vocab_size=vocab_size,
            context_tokens=context_tokens,
            dtype=dtype,
            force=force,
        )
    except FileExistsError as exc:
        print(f"error: {exc} (--force replaces it)")
        return 1
    except ValueError as exc:
        print(f"error: {exc}")
        return 1
    elapsed_s = time.perf_counter() - started_s
    files = sorted(p for p in folder.iterdir() if p.is_file())
    for path in files:
        print(f"{path.stat().st_size:>12,} bytes  {path}")
    total_bytes = sum(p.stat().st_size for p in files)
    print(
        f"{folder}: a {arch}-shaped model with random weights, "
        f"{parameter_count(folder):,} parameters, {total_bytes:,} bytes, "
        f"built in {elapsed_s:.1f} s"
    )
    return 0


@app.command("build", help="build the files of models built from a recipe (tiny-llama, tiny-gpt2)")
def build_models(
    names: Annotated[
        list[str] | None,
        typer.Argument(metavar="[NAME]...", help="models (default: all)", show_default=False),
    ] = None,
    repository_path: Annotated[
        Path | None,
        typer.Option(
            "--repository",
            metavar="PATH",
            help="a repository folder (default FERRY_MODEL_REPOSITORY)",
            show_default=False,
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="build them again even if built")] = False,
) -> int:
    import time

    from core.config.settings import get_settings
    from ferry.built_models import RecipeError, build, built_versions

    root = repository_path or get_settings().model_repository_path
    try:
        versions = built_versions(root, names or None)
    except RecipeError as exc:
        print(f"error: {exc}")
        return 1
    unknown = sorted(set(names or ()) - {v.model for v in versions})
    if unknown:
        print(f"error: {root} has no model built from a recipe named {', '.join(unknown)}")
        return 1
    for version in versions:
        started_s = time.perf_counter()
        if not build(version, force=force):
            if version.foreign():
                print(
                    f"{version.model} version {version.number}: {version.folder} holds model "
                    "files no recipe built; they are left as they are (--force replaces them)"
                )
            else:
                print(f"{version.model} version {version.number}: built already ({version.folder})")
            continue
        print(
            f"{version.model} version {version.number}: built in "
            f"{time.perf_counter() - started_s:.1f} s into {version.folder} (random weights: "
            "the text it generates is noise)"
        )
    return 0
