"""The command line lists every subcommand, and one whose module fails to import fails loudly."""

from __future__ import annotations

import pytest

from openalice_runner import cli


def test_every_command_module_registers():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name in ("generate", "bench", "bench-follow-up", "bench-constrained", "serve", "policy", "trace"):
        assert name in commands


def test_a_missing_command_module_is_an_error(monkeypatch):
    """Before: `build_parser` skipped a module it could not find, so the command vanished from --help."""
    monkeypatch.setattr(cli, "_COMMAND_MODULES", (*cli._COMMAND_MODULES, "no_such_command"))
    with pytest.raises(ModuleNotFoundError, match="no_such_command"):
        cli.build_parser()


def test_a_command_module_that_fails_to_import_is_an_error(monkeypatch, tmp_path):
    broken = tmp_path / "broken_command.py"
    broken.write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: __import__(name.rsplit(".", 1)[-1]))
    monkeypatch.setattr(cli, "_COMMAND_MODULES", ("broken_command",))
    with pytest.raises(RuntimeError, match="broken at import"):
        cli.build_parser()
