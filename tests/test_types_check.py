"""The middleware floors type-check clean: mypy, configured in pyproject.toml ([tool.mypy]: which
files, the engine side not followed), reports nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiers import import_or_missing

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_nothing_on_the_middleware_floors():
    import_or_missing("mypy", "mypy is in the dev extras (pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
