"""`openalice-runner serve` whose model passes after the first wait while a gate file exists.

A process test creates the file before its request and removes it when it has seen what it came
for: the first pass (the prefill) answers the first token, and the rest of the generation holds, so
"the request is still in flight" is a fact, not a race with a fast machine.
Run as `python -m tests.stand_ins.gated_serve GATE_PATH serve ...`."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

from openalice_runner.cli import main
from openalice_runner.engine.hf_model import HFCausalModel
from openalice_runner.engine.llama import LlamaModel

_passes = itertools.count()


def _gated(fn, gate: Path):
    def gated(*args, **kwargs):
        if next(_passes) > 0:
            while gate.exists():
                time.sleep(0.01)
        return fn(*args, **kwargs)

    return gated


def run(gate: Path, argv: list[str]) -> int:
    for cls, names in ((LlamaModel, ("forward", "forward_rows")), (HFCausalModel, ("forward",))):
        for name in names:
            setattr(cls, name, _gated(getattr(cls, name), gate))
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1]), sys.argv[2:]))
