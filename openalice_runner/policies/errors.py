"""A policy file that cannot be used: every problem pinned to FILE:LINE:COL."""

from __future__ import annotations

from openalice_runner.config_files.errors import ConfigError, Problem

__all__ = ["PolicyError", "Problem"]


class PolicyError(ConfigError):
    """A policy file that cannot be used; `problems` lists every problem found, in file order."""

    empty_message = "invalid policy"
