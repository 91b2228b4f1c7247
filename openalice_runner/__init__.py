"""openalice-runner: the model backend for the OpenAlice agentic loop."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Runner", "__version__"]


def __getattr__(name: str):
    # Lazy, so that `import openalice_runner` does not pull torch in.
    if name == "Runner":
        from openalice_runner.runner import Runner

        return Runner
    raise AttributeError(name)
