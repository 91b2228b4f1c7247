"""Torch-free parts of the embedded engine's provider (`type: local`, providers/local.py): its settings,
the prompt and its context bounds, the reply's grammar, tool-call rendering and streaming, the reply
and the one mapping of engine errors. Only providers/local.py imports the engine itself; what these
need of it, it hands in."""
