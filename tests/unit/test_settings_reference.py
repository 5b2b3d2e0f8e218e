"""The settings reference (docs/settings.md) is the settings' own descriptions, rendered."""

from __future__ import annotations

import pytest

from core.config import reference as settings_reference
from core.config.reference import COMMAND, PAGE, render
from core.config.settings import PER_MODEL, Settings


def rows() -> dict[str, tuple[str, str, str]]:
    """The rendered table rows by variable name: (default, type, description)."""
    found: dict[str, tuple[str, str, str]] = {}
    for line in render().splitlines():
        if line.startswith("| `FERRY_"):
            variable, default, meaning = (cell.strip() for cell in line.strip("| ").split(" | "))
            kind, description = meaning.split("<br>")
            found[variable.strip("`")] = (default, kind.strip("*"), description)
    return found


def test_every_setting_has_a_description() -> None:
    missing = [
        name
        for name, field in Settings.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert not missing, f"write a docstring under each of these fields of Settings: {missing}"


def test_the_page_is_the_rendering_of_the_settings() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/settings.md differs from the settings in core/config/settings.py: regenerate it "
        f"with `{COMMAND}`"
    )


def test_every_setting_has_one_row() -> None:
    expected = {f"FERRY_{name.upper()}" for name in Settings.model_fields}
    assert set(rows()) == expected
    text = render()
    assert all(text.count(f"| `{name}` |") == 1 for name in expected)


@pytest.mark.parametrize(
    ("variable", "default", "kind"),
    [
        ("FERRY_API_PORT", "`8000`", "integer, 1 to 65535"),
        ("FERRY_REDIS_URL", "unset", "string"),
        ("FERRY_DATA_DIR", "`.ferry`", "path"),
        ("FERRY_SCHEDULER", "`ferry`", "one of `ferry`, `fixed`, `none`; per model"),
        ("FERRY_BULK_SHARE", "`0.05`", "number, ≥ 0, < 1; per model"),
        ("FERRY_MEMORY_THRESHOLD", "`0.8`", "number, > 0, ≤ 1; per model"),
        ("FERRY_MODEL_POLL_S", "`1`", "number, ≥ 0"),
        ("FERRY_PIPELINE", "`true`", "boolean"),
        ("FERRY_MODEL_SETTINGS", "`{}`", "object"),
        ("FERRY_CORS_ORIGINS", "`[]`", "list of strings"),
        (
            "FERRY_WEBHOOK_RETRY_SCHEDULE_S",
            "`[0, 5, 300, 1800, 7200, 18000, 36000, 50400, 72000, 86400]`",
            "list of numbers, 1 to 50 entries",
        ),
        ("FERRY_FLOWER_PASSWORD", "unset", "string (secret)"),
        ("FERRY_BACKFILL_MAX_BYTES", "`1073741824`", "integer, ≥ 1024"),
    ],
)
def test_a_row_says_default_type_bounds_and_scope(variable: str, default: str, kind: str) -> None:
    assert rows()[variable][:2] == (default, kind)


def test_per_model_marks_exactly_the_per_model_settings() -> None:
    marked = {name for name, (_, kind, _) in rows().items() if kind.endswith("; per model")}
    assert marked == {f"FERRY_{name.upper()}" for name in PER_MODEL}


def test_groups_must_start_at_fields_in_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    swapped = (settings_reference.GROUPS[1], settings_reference.GROUPS[0])
    monkeypatch.setattr(settings_reference, "GROUPS", swapped + settings_reference.GROUPS[2:])
    with pytest.raises(ValueError, match="GROUPS"):
        render()
    monkeypatch.setattr(settings_reference, "GROUPS", (("no_such_setting", "Lost"),))
    with pytest.raises(ValueError, match="no_such_setting"):
        render()
