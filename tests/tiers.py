"""What a test tier needs installed, and what its absence means.

Outside CI a tier whose install is missing (a side venv, Node's packages, a Debian binary) skips,
saying what is missing and how to get it (`-rs` in pyproject's addopts prints every reason). Under
`CI=true`, where `.ci/run` installed everything or stopped, the same absence is a broken install: the
test fails naming the missing piece, so a failed install can never turn into a green run of skips.

Hardware skips (a CPU without AVX512-BF16 or AVX-512, not running as root) are not install skips:
they stay skips with their reason under CI too, and do not use this module.
"""

from __future__ import annotations

import importlib
import os
from typing import NoReturn

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def missing(reason: str) -> NoReturn:
    """`reason` names an install the test needs: a skip saying so, a failure under CI=true."""
    if under_ci():
        pytest.fail(f"CI=true, and an install this tier needs is missing: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def needs_install(problem: str | None) -> pytest.MarkDecorator:
    """A mark for a test (or, in `pytestmark`, a module): None when the install is there, else what
    is missing, which tests/conftest.py turns into `missing(problem)` when the test is set up."""
    return pytest.mark.needs_install(problem)


def import_or_missing(module: str, reason: str):
    """`pytest.importorskip` that fails under CI=true (an extra that did not install)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(f"{reason} ({exc})")
