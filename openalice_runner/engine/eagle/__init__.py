"""EAGLE-style draft heads: the head (head.py), self-distilled data (data.py), training (train.py).

The drafter that runs a head inside the decode loop is `engine/drafters/eagle.py`.
"""

from openalice_runner.engine.eagle.head import (
    EagleHead,
    EagleRuntime,
    HeadConfig,
    load_head,
    target_fingerprint,
)

__all__ = ["EagleHead", "EagleRuntime", "HeadConfig", "load_head", "target_fingerprint"]
