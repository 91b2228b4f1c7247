"""Where things are, for tests in any folder under tests/: the checkout, tests/ and the workloads beside it."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SHARED_WORKLOADS = REPO.parent / "shared" / "workloads"
