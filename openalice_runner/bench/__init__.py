"""Benchmarks of the embedded engine against itself and transformers' own generate."""
