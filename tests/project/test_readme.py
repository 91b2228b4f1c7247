"""The README's examples work as printed.

- The library example (the first ```python block that calls `Runner.from_config`) runs as pasted:
  on every run with the embedded model swapped for a scripted engine (so the tool-call branch is
  taken) and for the tiny random model (the real decode path); marked slow, unchanged, in a fresh
  interpreter against the real default model (SmolLM2-135M-Instruct).
- Every `openalice-runner ...` command line in the README (and in docs/) parses with the CLI's own
  parser: the subcommand and each flag exist and take the values shown.
- The policy and providers YAML examples load with the same loaders the runner uses.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from locations import REPO
from stand_ins.engines import tiny_engine
from stand_ins.scripted_engine import WEATHER_ANSWERS, ScriptedEngine

from openalice_runner import Runner

README = REPO / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(lang: str) -> list[str]:
    return [body for tag, body in _FENCE.findall(README.read_text()) if tag == lang]


def library_snippet() -> str:
    for body in _blocks("python"):
        if "Runner.from_config" in body:
            return body
    raise AssertionError("README has no ```python block calling Runner.from_config")


_COMMAND = re.compile(r"^\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\S*/)?openalice-runner(?:\s|$)")


def commands_in(path: Path) -> list[list[str]]:
    """Each line of `path` that runs `openalice-runner` (after optional VAR=value words and a path),
    joined with its backslash continuations, without a trailing # comment."""
    lines = path.read_text().splitlines()
    commands, i = [], 0
    while i < len(lines):
        line = lines[i].strip()
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        i += 1
        for segment in line.split("&&"):
            if _COMMAND.match(segment):
                words = shlex.split(segment, comments=True)
                while not words[0].endswith("openalice-runner"):
                    words = words[1:]
                commands.append(words[1:])
    return commands


def readme_commands() -> list[list[str]]:
    return commands_in(README)


def docs_commands() -> list[tuple[str, list[str]]]:
    return [(str(p.relative_to(REPO)), argv) for p in sorted((REPO / "docs").rglob("*.md")) for argv in commands_in(p)]


# ---- the CLI lines ----------------------------------------------------------------------------


def test_readme_commands_are_found():
    subcommands = {" ".join(argv[:2]) if argv[0] in ("policy", "trace", "draft") else argv[0] for argv in readme_commands()}
    # the quick start's `serve` and the commands the README presents must all be checked below
    assert {"serve", "policy check", "policy explain", "trace report", "generate", "bench", "loadtest"} <= subcommands


def _parses(argv: list[str], where: str) -> None:
    from openalice_runner.cli import build_parser

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on an unknown subcommand, flag or value
        pytest.fail(f"{where}: `openalice-runner {shlex.join(argv)}` does not parse (exit {exc.code})")
    assert callable(args.func)


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: " ".join(argv)[:60])
def test_readme_command_parses(argv):
    _parses(argv, "README.md")


def test_docs_commands_parse():
    found = docs_commands()
    assert len(found) >= 10  # docs/ shows the bench, policy, draft and loadtest commands
    for where, argv in found:
        _parses(argv, where)


# ---- the YAML examples ------------------------------------------------------------------------


def test_readme_yaml_examples_load():
    from openalice_runner.policies.loader import load_policy_text
    from openalice_runner.providers.config import load_routing_text

    yaml_blocks = _blocks("yaml")
    (policy,) = [b for b in yaml_blocks if "rules:" in b]
    (routing,) = [b for b in yaml_blocks if "routes:" in b]
    loaded = load_policy_text(policy, "README.md policy example")
    assert [rule.name for rule in loaded.policy.rules] == ["copy-heavy-small-batch", "copy-heavy-mid-batch"]
    config = load_routing_text(routing, "README.md providers example")
    assert set(config.providers) == {"cloud", "local"} and [r.name for r in config.routes] == ["tool-steps", "default"]


# ---- the library example ----------------------------------------------------------------------


def _run_snippet_with(engine, monkeypatch) -> None:
    """Execute the README text unchanged; only `Runner.from_config` gets `engine=` added."""
    original = Runner.from_config

    def from_config(cls, *args, **kwargs):
        kwargs.setdefault("engine", engine)
        return original(*args, **kwargs)

    monkeypatch.setattr(Runner, "from_config", classmethod(from_config))
    exec(compile(library_snippet(), "README.md (library example)", "exec"), {"__name__": "__main__"})


def test_library_example_runs_with_a_scripted_engine(monkeypatch, capsys):
    engine = ScriptedEngine(WEATHER_ANSWERS, completion_tokens=5)
    _run_snippet_with(engine, monkeypatch)
    out = capsys.readouterr().out
    assert len(engine.prompts) == 2  # the tool call, then the streamed answer
    assert 'get_weather tool returned: {"city": "Paris", "temperature_c": 21' in engine.prompt_texts[1]
    assert "speculation:" in out and "It is 21 degrees and sunny in Paris." in out


def test_library_example_runs_on_the_tiny_random_model(monkeypatch, capsys):
    _run_snippet_with(tiny_engine(), monkeypatch)
    assert "speculation:" in capsys.readouterr().out


@pytest.mark.slow
def test_library_example_runs_as_pasted_on_the_default_model(tmp_path):
    script = tmp_path / "readme_example.py"
    script.write_text(library_snippet())
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "speculation: " in proc.stdout
    answer = proc.stdout.split("\n", 1)[1] if "\n" in proc.stdout else ""
    assert answer.strip(), proc.stdout
