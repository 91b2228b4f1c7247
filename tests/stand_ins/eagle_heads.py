"""A tiny trained EAGLE head, for tests of the eagle drafter and of providers that use one."""

from __future__ import annotations

import json
from pathlib import Path

from openalice_runner.training.data import builtin_prompts
from openalice_runner.training.pipeline import BuildSettings, build_head


def build_tiny_head(engine, root: Path, feature_layers, layout: str = "eagle", unroll: int = 1):
    """A head trained for 30 steps on 24 built-in prompts; returns (folder, figures, root)."""
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in builtin_prompts(24, seed=3)))
    settings = BuildSettings(minutes=2.0, max_new_tokens=24, draft_vocab=2048, heldout_every=6, max_steps=30,
                             progress=False, data_dir=root / "data", feature_layers=feature_layers, layout=layout,
                             unroll=unroll)
    folder, figures = build_head(engine, [data], root / "head", settings=settings)
    return folder, figures, root
