"""What a draft head folder and a served model folder say about their target, from config.json with
json alone (no torch): what `policy check --providers` holds an EAGLE pool's head against.

A head folder's config.json is one of:
- the `eagle3` layout (SpecForge's `LlamaForCausalLMEagle3`, engine/eagle/eagle3.py): the runner's
  target fingerprint under its own key, `openalice_runner.target`, beside SpecForge's config;
- the runner's own `eagle` layout (engine/eagle/head.py): `target` at the top, which vLLM and SGLang
  do not load;
- a head from elsewhere (SpecForge, a public one): no fingerprint, only its `hidden_size` and
  `vocab_size` (the target's), so it can be held to those alone.
A fingerprint carries the target's name (the engine's model name: `SmolLM2-135M-Instruct` for the
default model, a folder's or .gguf's own name otherwise), hidden and vocabulary sizes, layer count
and LM-head hash (which only the engine, with the weights loaded, can check).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.json"
OWN_KEY = "openalice_runner"  # the runner's entry in an eagle3 folder's config.json (engines ignore it)
# config.json architectures vLLM and SGLang load as an EAGLE-3 Llama head (SGLang registers the first)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# the engine's name for its default model (engine/model_loading.py DEFAULT_MODEL_NAME; a test holds
# them equal): what a head trained on it carries, and what a vLLM pool's `model_path: embedded` serves
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# engine/model_loading.py converted_folder: NAME-KEY, KEY 16 hex digits of the source file, and a
# `complete` marker once written: the runner's conversion of model NAME
_CONVERTED = re.compile(r"^(?P<name>.+)-[0-9a-f]{16}$")


@dataclass(frozen=True)
class HeadTarget:
    """What a head folder's config.json says of the target it was trained for."""

    layout: str  # eagle3 | eagle | other
    fingerprint: dict | None  # the runner's: name, vocab_size, hidden, n_layers, lm_head_sha256
    hidden: int | None  # hidden_size (the target's: an EAGLE head's width is its target's)
    vocab_size: int | None  # the target's vocabulary


@dataclass(frozen=True)
class ModelShape:
    """A served model as far as this machine can tell: the names it goes by, and its sizes where it
    is a local folder with a config.json."""

    names: tuple[str, ...]
    hidden: int | None = None
    vocab_size: int | None = None
    n_layers: int | None = None
    config: Path | None = None  # the config.json the sizes come from


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def _int(raw: dict, key: str) -> int | None:
    value = raw.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_head_target(folder: Path) -> HeadTarget:
    """The target `folder`'s config.json names; ValueError where there is no readable config.json."""
    raw = _read_json(folder / CONFIG_FILE)
    if any(a in EAGLE3_ARCHITECTURES for a in raw.get("architectures") or ()):
        own = raw.get(OWN_KEY)
        fingerprint = own.get("target") if isinstance(own, dict) else None
        return HeadTarget("eagle3", fingerprint if isinstance(fingerprint, dict) else None,
                          _int(raw, "target_hidden_size") or _int(raw, "hidden_size"), _int(raw, "vocab_size"))
    if isinstance(raw.get("target"), dict) and "format_version" in raw:
        fp = raw["target"]
        return HeadTarget("eagle", fp, _int(fp, "hidden"), _int(fp, "vocab_size"))
    return HeadTarget("other", None, _int(raw, "hidden_size"), _int(raw, "vocab_size"))


def model_shape(model: str) -> ModelShape:
    """The model a pool serves (`--model`/`--model-path`): its names, and its sizes where it is a
    local folder (a text model's config.json, or its `text_config`). ValueError where that
    config.json cannot be read."""
    path = Path(model)  # as the engine opens it
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        raw = _read_json(path / CONFIG_FILE)
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        names = [path.name]
        converted = _CONVERTED.match(path.name)
        if converted and (path / "complete").is_file():
            names.append(converted.group("name"))
        return ModelShape(tuple(names), _int(text, "hidden_size"), _int(text, "vocab_size"),
                          _int(text, "num_hidden_layers"), path / CONFIG_FILE)
    if path.suffix == ".gguf":
        return ModelShape((path.stem,))
    return ModelShape((model.rstrip("/").rsplit("/", 1)[-1],))  # a hub id: owner/NAME
