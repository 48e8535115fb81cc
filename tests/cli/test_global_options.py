"""Global options anywhere on the line, and `KAFOLD_CONFIG` in place of `-c` (pure argument handling, no services)."""

from __future__ import annotations

import pytest

from kafold.tools import cli
from tests.support import ROOT

BANK = str(ROOT / "examples" / "bank" / "kafold.toml")


@pytest.mark.parametrize(("argv", "expected"), [
    (["dlq", "list", "--debug"], ["--debug", "dlq", "list"]),
    (["status", "--log-format", "json", "-c", "k"], ["--log-format", "json", "status", "-c", "k"]),
    (["status", "--log-format=console"], ["--log-format=console", "status"]),
    (["command", "send", "--", "--debug"], ["command", "send", "--", "--debug"]),
])
def test_global_options_move_before_the_command(argv: list[str], expected: list[str]) -> None:
    assert cli.hoist_global_options(argv) == expected


def test_global_options_after_the_command_are_taken(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", "validate", "-c", BANK, "--debug", "--log-format", "json"]) == 0
    assert "ok" in capsys.readouterr().out


def test_kafold_config_names_the_file(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KAFOLD_CONFIG", BANK)
    assert cli.main(["config", "validate"]) == 0
    assert "kafold.toml: ok" in capsys.readouterr().out


def test_without_kafold_config_the_file_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAFOLD_CONFIG", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["config", "validate"])
    assert e.value.code == 2
