"""EAGLE-style draft heads: the head (head.py) as serving loads and runs it.

The drafter that runs a head inside the decode loop is `engine/drafters/eagle.py`; training a head
(data, loop, pipeline) is the `openalice_runner.training` package, which serving never imports.
"""

from openalice_runner.engine.eagle.head import (
    EagleHead,
    EagleRuntime,
    HeadConfig,
    load_head,
    target_fingerprint,
)

__all__ = ["EagleHead", "EagleRuntime", "HeadConfig", "load_head", "target_fingerprint"]
