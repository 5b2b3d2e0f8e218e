"""The suite's assertion-rewritten bytecode, written once before pytest's workers start.

pytest rewrites the asserts of what it imports as a test: every test module
and conftest, the modules registered with ``register_assert_rewrite``
(harness) and the plugins it loads (hypothesis, schemathesis, xdist, ...). It
caches the rewritten code beside the source, unless ``PYTHONDONTWRITEBYTECODE``
is set, as it is where CI runs ``make test``: then each xdist worker rewrites
them all again, about 7 CPU seconds of the 18 its collection takes. pytest
reads the cache even where it would not write it, so ``make test`` runs this
once, with bytecode writing on, and its workers read what it wrote:

    python -m pytest -p tests.assert_cache

By the time its hook runs, pytest has imported its plugins and the root
conftest, rewriting and caching them; the hook rewrites the rest (the test
modules, the other conftests, harness) and ends the run without collecting.
The cache is pytest's own, checked against each source's hash, so a file
changed afterwards is rewritten again as it would be without this.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest
from _pytest.assertion import rewrite
from _pytest.assertion.rewrite import PYC_TAIL, get_cache_dir


def rewritten_by_pytest(config: pytest.Config) -> list[Path]:
    """The files pytest rewrites when it imports them: each testpath's test modules (its
    ``python_files`` patterns) and conftests, and the registered packages' modules."""
    from tests.conftest import ASSERTS_REWRITTEN  # loaded by pytest by now

    root = config.rootpath
    patterns = [*config.getini("python_files"), "conftest.py"]
    found: set[Path] = set()
    for testpath in config.getini("testpaths") or ["."]:
        for path in (root / testpath).rglob("*.py"):
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in patterns):
                found.add(path)
    for package in ASSERTS_REWRITTEN:
        found.update((root / package).rglob("*.py"))
    return sorted(found)


def write(config: pytest.Config, paths: list[Path]) -> int:
    """Rewrite each of ``paths`` and cache it where pytest looks; the number written
    (those whose cache already holds the same source are left)."""
    state = config.stash[rewrite.assertstate_key]
    written = 0
    for path in paths:
        pyc = get_cache_dir(path) / (path.name[:-3] + PYC_TAIL)
        if rewrite._read_pyc(path, pyc) is not None:
            continue
        if not rewrite.try_makedirs(pyc.parent):
            continue
        source_hash, code = rewrite._rewrite_test(path, config)
        written += rewrite._write_pyc(state, code, source_hash, pyc)
    return written


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int:
    if sys.dont_write_bytecode:
        # pytest would not have cached the plugins it imported: the run would be half done.
        raise pytest.UsageError("tests.assert_cache writes bytecode: unset PYTHONDONTWRITEBYTECODE")
    paths = rewritten_by_pytest(config)
    written = write(config, paths)
    print(f"assertion rewriting: {written} of {len(paths)} files written to pytest's cache")
    return 0
