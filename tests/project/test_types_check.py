"""The middleware floors type-check clean: mypy, configured in pyproject.toml ([tool.mypy]: which
files, the engine side not followed), reports nothing."""

from __future__ import annotations

import subprocess
import sys

from locations import REPO
from tiers import import_or_missing


def test_mypy_finds_nothing_on_the_middleware_floors():
    import_or_missing("mypy", "mypy is in the dev extras (pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
