"""What the commands print: plain and parseable off a terminal, Rich on one."""

from __future__ import annotations

import io

import pytest

from ferry import console
from ferry.console import PlainBar, plain_rows, show_fields, show_table
from ferry.keys_cli import _plain_keys


def test_plain_columns_are_aligned_two_spaces_apart_with_a_dash_for_nothing() -> None:
    assert plain_rows(("id", "status", "finished"), [("a1", "queued", None), ("b", "ok", 3)]) == [
        "id  status  finished",
        "a1  queued  -",
        "b   ok      3",
    ]


def test_the_keys_list_keeps_its_columns() -> None:
    header, row = _plain_keys(
        ("id", "scope", "created", "revoked", "name"),
        [("abc", "admin", "2025-01-02 03:04:05", "-", "ops team")],
    )
    assert header == f"{'id':16}  {'scope':6}  {'created':20}  {'revoked':20}  name"
    assert row == f"{'abc':16}  {'admin':6}  {'2025-01-02 03:04:05':20}  {'-':20}  ops team"


def test_a_table_and_fields_are_plain_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    show_table(("name", "workers"), [("sim", 1)])
    show_fields([("id", "j1"), ("error", None), ("status", "succeeded")])
    assert capsys.readouterr().out == "name  workers\nsim   1\nid      j1\nstatus  succeeded\n"


def test_a_table_is_drawn_by_rich_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(console, "on_terminal", lambda stream=None: True)
    show_table(("name", "workers"), [("sim", 1)])
    out = capsys.readouterr().out
    assert "─" in out and "name" in out and "sim" in out  # Rich's rule under the header


def test_the_plain_bar_prints_a_line_every_5_s_and_the_last_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    bar = PlainBar(stream)
    bar.show("in_progress", 10, 100, "10/100")
    now[0] += 1
    bar.show("in_progress", 20, 100, "20/100")  # within 5 s: not printed
    now[0] += 5
    bar.show("in_progress", 30, 100, "30/100")
    bar.show("completed", 100, 100, "100/100")  # the end always is
    assert stream.getvalue().splitlines() == [
        "in_progress [###---------------------------]  10.0%  10/100",
        "in_progress [#########---------------------]  30.0%  30/100",
        "completed [##############################] 100.0%  100/100",
    ]


def test_the_rich_bar_draws_on_the_stream_and_ends_cleanly() -> None:
    stream = io.StringIO()
    bar = console.RichBar(stream)
    bar.show("upload", 512, 1024, "512 B/1.0 KiB")
    bar.show("upload", 1024, 1024, "1.0 KiB/1.0 KiB")
    bar.end()
    assert "upload" in stream.getvalue() and "1.0 KiB/1.0 KiB" in stream.getvalue()
