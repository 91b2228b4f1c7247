"""How a stream's tokens leave the runner (`serve --stream-release`): the rhythm and sizes of its events.

Speculative decoding accepts a text-dependent number of tokens per target pass, so one event per
pass tells an observer of the (encrypted) stream about the text (arXiv 2411.01076, 2511.03675).
The re-chunking runs on the unified chunk stream (types.ChatChunk), before any wire formats it, so
it is the same for the embedded engine and for pool streams:

    modes.py   the modes (pass, fixed:N, paced), parsed from the flag, resolved per request
    stream.py  a stream's chunks as the groups that leave together, one write each
    units.py   what a token is at the chunk layer, and chunks cut into and rebuilt from them
    fixed.py   fixed:N: N tokens an event
    clocked.py fixed:N and paced (N = 1) on the clock of the tenant's recent decode rate; +pad
    paced.py   paced's first stream of a tenant: one token an event on a clock of its own rate
    padding.py every write padded to a size bucket with an SSE comment line (fixed:N and paced)
"""
