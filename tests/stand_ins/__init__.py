"""Stand-in servers for what cannot run here (SGLang needs a GPU; hosted APIs need the internet).

Each is a real HTTP server on loopback speaking the real protocol field for field.
"""
