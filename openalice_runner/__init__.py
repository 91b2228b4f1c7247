"""openalice-runner: the model backend for the OpenAlice agentic loop."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["DEFAULT_POLICY", "NO_POLICY", "Runner", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `import openalice_runner` does not pull torch in.
    if name in ("Runner", "DEFAULT_POLICY", "NO_POLICY"):
        from openalice_runner import runner

        return getattr(runner, name)
    raise AttributeError(name)
