"""``ferry models``: what the model repository holds, and whether Ferry can serve it.

``check`` reads every model.toml and asks each model's backend about its
files and parameters, without loading a model: each problem names the file
and the field. It exits 1 on an error (a model that FERRY_MODELS serves, or
a model.toml that cannot be read), 0 when there are only warnings (files
missing from a model that is not served).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from backends.catalog import check, model_problems, repository_for
from core.repository import Problem
from core.settings import get_settings


def _check(args: argparse.Namespace) -> int:
    settings = get_settings()
    if args.path is not None:
        settings = settings.model_copy(update={"model_repository": Path(args.path)})
    repository = repository_for(settings)
    # A folder named on the command line is checked whole unless FERRY_MODELS says otherwise.
    whole = args.all or (args.path is not None and "models" not in settings.model_fields_set)
    served = None if whole else settings.model_names
    problems = check(repository, served)
    report(problems)
    errors = [p for p in problems if not p.warning]
    for model in repository.models.values():
        if served is not None and model.name not in served:
            continue
        mark = "problems" if any(model.concerns(p) for p in errors) else "ok"
        versions = ", ".join(
            f"{n}{' (active)' if n == model.active_version else ''}" for n in sorted(model.versions)
        )
        print(f"{model.name:20} {model.backend:22} versions {versions:16} {mark}")
    if errors:
        print(f"{len(errors)} problem(s) in {repository.root}: Ferry cannot serve it as it is")
        return 1
    print(f"{repository.root}: ready to serve")
    return 0


def report(problems: list[Problem]) -> None:
    for problem in problems:
        print(f"{'warning' if problem.warning else 'error'}: {problem}")


def _list(args: argparse.Namespace) -> int:
    settings = get_settings()
    repository = repository_for(settings)
    served = set(settings.model_names)
    active = {name: model.active_version for name, model in repository.models.items()}
    try:  # an operator's activations, where the database can be reached
        from core.versions import active_version
        from ferry.keys_cli import database_session

        with database_session() as session:
            active = {n: active_version(session, m) for n, m in repository.models.items()}
    except Exception as exc:
        print(f"(activations not read: {str(exc).splitlines()[0][:200]})")
    print(f"{'model':20} {'backend':22} {'input':7} {'active':>6}  {'versions':10} served")
    for model in repository.models.values():
        versions = ",".join(map(str, sorted(model.versions)))
        print(
            f"{model.name:20} {model.backend:22} {model.input.kind:7} {active[model.name]:>6}  "
            f"{versions:10} {'yes' if model.name in served else 'no'}"
        )
    return 0


def _activate(args: argparse.Namespace) -> int:
    from core.versions import ActivationError, activate, active_version
    from ferry.keys_cli import database_session

    settings = get_settings()
    repository = repository_for(settings)
    model = repository.models.get(args.name)
    if model is None:
        print(f"error: the repository ({repository.root}) has no model {args.name!r}")
        return 1
    problems = model_problems(model, [args.version]) if args.version in model.versions else []
    if problems:
        report(problems)
        print(f"{args.name}@{args.version} is not activated: its files have problems")
        return 1
    with database_session() as session:
        previous = active_version(session, model)
        try:
            activate(session, model, args.version)
        except ActivationError as exc:
            print(f"error: {exc}")
            return 1
    print(
        f"{args.name}: version {args.version} is active (was {previous}); workers load it, "
        f"switch new batches to it and drop the old one within FERRY_MODEL_POLL_S "
        f"({settings.model_poll_s:g} s) plus its load time"
    )
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = sub.add_parser("models", help="the model repository: list and check it")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    checker = models_sub.add_parser(
        "check", help="check a repository (default FERRY_MODEL_REPOSITORY) without loading models"
    )
    checker.add_argument("path", nargs="?", help="a repository folder")
    checker.add_argument(
        "--all", action="store_true", help="errors for every model, not only those served"
    )
    checker.set_defaults(fn=_check)
    models_sub.add_parser("list", help="the repository's models and versions").set_defaults(
        fn=_list
    )
    activator = models_sub.add_parser(
        "activate", help="make a version the active one (a rollback too): workers switch to it"
    )
    activator.add_argument("name")
    activator.add_argument("version", type=int)
    activator.set_defaults(fn=_activate)
