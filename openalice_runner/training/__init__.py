"""Training EAGLE-style draft heads offline (`openalice-runner draft`): self-distilled data (data.py),
the training loop (train.py), and prompts -> cached samples -> a saved head (pipeline.py).

Serving never imports this package: the head itself is `engine/eagle/head.py` and the drafter that
runs it is `engine/drafters/eagle.py`.
"""
