"""The embedded provider's wing (`type: local` in a routing file): the engine in-process as a provider.

The provider itself is providers/local.py, beside this folder: the one module of the middleware that
imports the engine (torch). Everything here is torch-free, so that reading a routing file never loads torch: its settings (config.py), the prompt and
its context bounds, the reply's grammar, tool-call rendering and streaming, the reply and the one
mapping of engine errors. What these need of the engine, local.py hands in."""
