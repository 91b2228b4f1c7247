"""The default policy and routing config, shipped inside the package.

policy.yaml and providers.yaml are copies of the repository's policies/default.yaml and
providers/default.yaml (the operators' editable copies); tests/project/test_packaging.py keeps them identical.
They live here so that an install from a wheel, with no checkout around it, still finds them.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

POLICY = "policy.yaml"
PROVIDERS = "providers.yaml"


def text(name: str) -> str:
    return files(__name__).joinpath(name).read_text(encoding="utf-8")


def path(name: str) -> Path:
    """The shipped file on disk (the runner watches it like any policy file)."""
    resource = files(__name__).joinpath(name)
    if not isinstance(resource, Path):  # e.g. imported from a zip archive
        raise RuntimeError(f"openalice_runner/defaults/{name} is not on a file system: install the package unzipped")
    return resource
