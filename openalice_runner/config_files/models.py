"""The one base of the pydantic models that read operator files and API requests."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown fields are an error, not silently dropped: a typo should name itself."""

    model_config = ConfigDict(extra="forbid")
