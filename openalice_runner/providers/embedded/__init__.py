"""The embedded provider's wing (`type: local` in a routing file): the engine in-process as a provider.

provider.py is the provider and the one module here that imports the engine (torch); the rest is
torch-free, so that reading a routing file never loads torch: its settings (config.py), the prompt and
its context bounds, the reply's grammar, tool-call rendering and streaming, the reply and the one
mapping of engine errors. What these need of the engine, provider.py hands in."""
