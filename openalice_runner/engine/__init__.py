"""The embedded engine: torch + transformers, exact speculative decoding on a CPU.

The names below load on first use (PEP 562), so that importing the torch-free submodule
`openalice_runner.engine.types` (which providers/local.py needs for its config) does not pull torch
into an install without the engine extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openalice_runner.engine.engine import Engine
    from openalice_runner.engine.errors import ContextLengthError, InvalidRequest
    from openalice_runner.engine.model_loading import ModelNotFoundError
    from openalice_runner.engine.types import (
        GenerationResult,
        GenerationStats,
        SamplingParams,
        SpecConfig,
        StreamEvent,
    )

_WHERE = {
    "ContextLengthError": "errors",
    "Engine": "engine",
    "GenerationResult": "types",
    "GenerationStats": "types",
    "InvalidRequest": "errors",
    "ModelNotFoundError": "model_loading",
    "SamplingParams": "types",
    "SpecConfig": "types",
    "StreamEvent": "types",
}

__all__ = [
    "ContextLengthError",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "InvalidRequest",
    "ModelNotFoundError",
    "SamplingParams",
    "SpecConfig",
    "StreamEvent",
]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"openalice_runner.engine.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
