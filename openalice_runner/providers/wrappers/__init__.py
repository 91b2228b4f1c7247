"""Wrappers that compose providers: each holds an inner provider and adds one concern (admission,
instrumentation, the speculation policy, fallback), all built on the base wrapper."""
