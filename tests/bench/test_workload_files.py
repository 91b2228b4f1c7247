"""Workload files' stdlib contexts: lines of a standard-library module's source."""

from __future__ import annotations

import sys

import pytest

from openalice_runner.workload_files import stdlib_context


def test_stdlib_context_quotes_the_lines_asked_for():
    text = stdlib_context({"stdlib": "json", "lines": [1, 3]})
    assert len(text.splitlines()) == 3


def test_an_extension_module_is_named_not_a_type_error():
    # inspect finds math's shared object but no source: Path(None) was a TypeError
    if "math" in sys.builtin_module_names:
        pytest.skip("this interpreter has math built in, not as an extension module")
    with pytest.raises(ValueError, match="'math' has no source file"):
        stdlib_context({"stdlib": "math", "lines": [1, 2]})
