"""A head folder of either layout, told apart by its config.json, loaded for a target.

`eagle` (head.py): the runner's own layout, head.safetensors + config.json. `eagle3` (eagle3.py):
SpecForge's `LlamaForCausalLMEagle3` folder, model.safetensors + config.json, which vLLM and
SGLang load as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

from openalice_runner.engine.eagle.head import CONFIG_FILE, EagleRuntime, HeadRuntime, load_head
from openalice_runner.engine.llama import LlamaModel


def layout_of(folder: str | Path) -> str:
    """'eagle3' where config.json names an EAGLE-3 Llama architecture, else 'eagle' (whose
    loader says what a folder that is neither lacks)."""
    from openalice_runner.engine.eagle.eagle3_config import is_eagle3_config

    path = Path(folder).expanduser() / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return "eagle"
    return "eagle3" if isinstance(raw, dict) and is_eagle3_config(raw) else "eagle"


def load_runtime(folder: str | Path, model_name: str, model: LlamaModel) -> HeadRuntime:
    """The runtime of the head in `folder`, of whichever layout; ValueError (naming the field)
    where it is not a head or belongs to another target."""
    if layout_of(folder) == "eagle3":
        from openalice_runner.engine.eagle.eagle3 import Eagle3Runtime, load_eagle3

        return Eagle3Runtime(load_eagle3(folder, model_name, model), model)
    return EagleRuntime(load_head(folder, model_name, model), model)
