"""The ``ferry`` command line: every command listed, shell completion offered, usage errors in
argparse's words with its exit status, and nothing heavy loaded to parse it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ferry.cli import main

COMMANDS = ("up", "api", "worker", "celery", "flower", "keys", "backfill", "models", "jobs", "db")
SUBCOMMANDS = {
    "keys": ("create", "list", "revoke", "rotate", "embeddings-lane", "weight"),
    "backfill": ("submit", "status", "results", "cancel"),
    "models": ("list", "check", "repository", "activate", "build-lm", "build"),
    "jobs": ("submit", "get", "wait", "cancel", "list"),
    "db": ("upgrade",),
}


def commands_in(help_text: str) -> list[str]:
    """The names under the help's "Commands:" heading."""
    listed = help_text.split("Commands:", 1)[1].splitlines()
    return [line.split()[0] for line in listed if line.startswith("  ") and line.strip()]


def test_help_lists_every_command_and_offers_completion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert sorted(commands_in(out)) == sorted(COMMANDS)
    assert "--install-completion" in out and "--show-completion" in out
    for group, names in SUBCOMMANDS.items():
        assert main([group, "--help"]) == 0
        assert sorted(commands_in(capsys.readouterr().out)) == sorted(names), group


def test_completion_names_commands_and_choices() -> None:
    def complete(words: str) -> list[str]:
        env = {"_FERRY_COMPLETE": "complete_bash", "COMP_WORDS": words}
        env["COMP_CWORD"] = str(len(words.split()) - (0 if words.endswith(" ") else 1))
        run = subprocess.run(
            [sys.executable, "-m", "ferry"], env=env, capture_output=True, text=True, timeout=60
        )
        return run.stdout.split()

    assert complete("ferry jo") == ["jobs"]
    assert complete("ferry keys create --scope ") == ["client", "admin"]
    assert complete("ferry celery ") == ["worker", "beat"]


def test_a_usage_error_exits_2_in_argparses_words(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "create", "--name", "x", "--scope", "root"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'root' (choose from 'client', 'admin')" in err
    assert err.startswith("Usage: ferry keys create")  # plain off a terminal: no Rich panel
    assert main(["celery", "both"]) == 2
    assert "invalid choice: 'both'" in capsys.readouterr().err
    assert main(["worker"]) == 2
    assert "Missing option '--model'" in capsys.readouterr().err
    assert main([]) == 2  # no command: the help, as a usage error
    assert "Commands:" in capsys.readouterr().err


def test_parsing_the_command_line_loads_no_model_or_database_code() -> None:
    probe = (
        "import sys\n"
        "from ferry.cli import main\n"
        "for args in (['--help'], ['jobs', 'submit', '--help'], ['models', '--help']):\n"
        "    assert main(args) == 0\n"
        "heavy = ('torch', 'transformers', 'onnxruntime', 'sqlalchemy', 'celery', 'workers')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", "import json\n" + probe],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.splitlines()[-1]) == []
