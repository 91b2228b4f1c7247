"""The SGLang dialect of the pool provider: reply and load reading (provider.py), a pool's launch
settings and the checks that need only them (launch.py), its servers' flags from those settings and
the policy's rules routed to it (args.py), and `openalice-runner sglang args` (cli.py). Nothing is
imported here, so that reading launch settings does not load the provider."""
