# SPDX-License-Identifier: Apache-2.0
"""hkvd.shim.timeline: off it records nothing and opens nothing; on it writes whole JSON lines once per flush;
the reader's first events and step counts; the timeline_path option's checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hkvd.shim import timeline
from hkvd.shim.shim_config import ShimConfig
from hkvd.shim.timeline import OFF, Timeline


def test_off_records_nothing() -> None:
    OFF.note("r", "arrival")
    OFF.flush()
    OFF.close()
    assert not OFF.on and not OFF._buf


def test_events_are_written_once_per_flush_as_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    tl = Timeline(str(path))
    tl.step = 3
    tl.note("a", "arrival")
    tl.note("a", "first_schedule")
    assert path.read_text() == ""  # buffered until the step's flush
    tl.flush()
    other = Timeline(str(path))  # another process of the engine appends to the same file
    other.step = 4
    other.note("a", "load_done")
    other.close()
    tl.note("a", "first_forward")
    tl.close()
    tl.close()  # idempotent
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in lines] == [("arrival", 3), ("first_schedule", 3), ("load_done", 4),
                                                        ("first_forward", 3)]
    assert all(e["req"] == "a" and e["pid"] == os.getpid() for e in lines)
    assert lines[0]["t"] <= lines[1]["t"] <= lines[2]["t"]


def test_a_first_event_is_noted_once_per_request_until_it_is_forgotten(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    tl = Timeline(str(path))
    for step in (1, 2):
        tl.step = step
        tl.note_first("a", "first_forward")  # scheduled again in step 2: not a first forward
        tl.note_first("b", "first_forward")
    tl.forget("a")
    tl.step = 3
    tl.note_first("a", "first_forward")  # a finished request's id seen again: noted anew
    tl.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(e["req"], e["step"]) for e in lines] == [("a", 1), ("b", 1), ("a", 3)]
    OFF.note_first("a", "first_forward")
    assert not OFF._buf and not OFF._firsts


def test_a_failed_write_turns_the_timeline_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tl = Timeline(str(tmp_path / "t.jsonl"))
    os.close(tl._fd)  # the descriptor goes bad under it
    tl.note("a", "arrival")
    tl._fd = os.open(os.devnull, os.O_RDONLY)  # a write fails with EBADF
    tl.flush()
    assert not tl.on and "timeline failed" in caplog.text
    tl.note("a", "finished")
    assert not tl._buf


def test_the_reader_takes_whole_lines_and_counts_steps(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [("h", "arrival", 0.0, 5), ("h", "first_schedule", 0.1, 5), ("h", "load_planned", 0.2, 5),
            ("m", "arrival", 0.25, 5), ("m", "first_schedule", 0.3, 5), ("h", "first_schedule", 0.35, 6),
            ("m", "first_forward", 0.4, 5), ("h", "first_forward", 0.5, 6)]
    text = "".join(json.dumps({"req": r, "event": e, "t": t, "step": s, "pid": 1}) + "\n" for r, e, t, s in rows)
    path.write_text(text + '{"req": "h", "ev')  # a line being written: read next time
    by_req, offset = timeline.read(str(path))
    assert offset == len(text.encode()) and set(by_req) == {"h", "m"}
    assert timeline.firsts(by_req["h"])["first_schedule"]["step"] == 5  # the first of two
    assert timeline.steps_to_forward(by_req["h"]) == 1 and timeline.steps_to_forward(by_req["m"]) == 0
    assert timeline.steps_to_forward(by_req["h"][:3]) is None
    assert timeline.read(str(path), offset)[0] == {}


def test_timeline_path_is_checked_at_startup(tmp_path: Path) -> None:
    assert ShimConfig.from_extra({}).timeline_path == ""
    assert ShimConfig.from_extra({"timeline_path": str(tmp_path / "t.jsonl")}).timeline_path.endswith("t.jsonl")
    with pytest.raises(ValueError, match="is a folder"):
        ShimConfig.from_extra({"timeline_path": str(tmp_path)})
    with pytest.raises(ValueError, match="does not exist"):
        ShimConfig.from_extra({"timeline_path": str(tmp_path / "no" / "t.jsonl")})
    with pytest.raises(ValueError, match="is not a path"):
        ShimConfig.from_extra({"timeline_path": None})
