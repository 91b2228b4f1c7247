"""Issue 34, finding 6: the prompt log and the trace file refuse a file with another hard link
(another name for the same data, which chmod on this name would not make private)."""

from __future__ import annotations

import os
import stat

import pytest

from openalice_runner.private_file import PrivateFileError
from openalice_runner.prompt_log import PromptLog
from openalice_runner.tracing.jsonl import JsonLinesSpanExporter


@pytest.mark.parametrize("make", [PromptLog, JsonLinesSpanExporter])
def test_a_hard_linked_file_is_refused_and_left_as_it_was(tmp_path, make):
    public = tmp_path / "public.txt"
    public.write_text("readable by all\n")
    public.chmod(0o644)
    linked = tmp_path / "prompts.jsonl"
    os.link(public, linked)
    with pytest.raises(PrivateFileError, match="has 2 hard links"):
        make(linked)
    assert public.read_text() == "readable by all\n"  # nothing appended
    assert stat.S_IMODE(public.stat().st_mode) == 0o644  # and its mode not changed behind the owner's back
    public.unlink()  # one link left: now it may be used, and becomes owner-only
    make(linked)
    assert stat.S_IMODE(linked.stat().st_mode) == 0o600
