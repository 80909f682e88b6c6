"""A trace folder holding something that is not a file under a trace's name is refused in one line."""

from __future__ import annotations

import os

import pytest

from fastverify.errors import UserError
from fastverify.trace.load import load_traces


def test_a_fifo_named_like_a_trace_in_a_folder_is_refused_not_skipped(tmp_path):
    (tmp_path / "a.json").write_text('{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2}]}')
    os.mkfifo(tmp_path / "b.json.gz")
    with pytest.raises(UserError) as ei:
        load_traces([tmp_path])
    assert (
        str(ei.value)
        == f"{tmp_path / 'b.json.gz'}: not a regular file (a trace folder's *.json / *.json.gz must be files)"
    )
