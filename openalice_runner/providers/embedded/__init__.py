"""Torch-free helpers of the embedded engine's provider (`type: local`, providers/local.py): its settings,
tool-call rendering and streaming. Only providers/local.py imports the engine itself."""
