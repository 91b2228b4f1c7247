"""The embedded engine: torch + transformers, exact speculative decoding on a CPU."""

from openalice_runner.engine.engine import Engine
from openalice_runner.engine.generator import ContextLengthError
from openalice_runner.engine.model_loading import ModelNotFoundError
from openalice_runner.engine.types import (
    GenerationResult,
    GenerationStats,
    SamplingParams,
    SpecConfig,
    StreamEvent,
)

__all__ = [
    "ContextLengthError",
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "ModelNotFoundError",
    "SamplingParams",
    "SpecConfig",
    "StreamEvent",
]
