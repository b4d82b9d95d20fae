"""The one record type of the lines a job writes (common/tagged.py): each record's line reads back
as itself, and a line of another tag, missing a key or holding a bad value is no record."""

import pytest

from common.rundir import HangLine, SaveLine
from jobs.slurm.bad_nodes import BadNode

NOW = "2026-11-29T00:00:00+00:00"
RECORDS = [SaveLine(40, 95_500, 10**9, 2500, NOW), HangLine(3, "nid7", 9, 61.0, 20.0, on_time=False),
           HangLine(0, "nid7", 9, 20.0, 20.5, on_time=True), BadNode("nid7", NOW, NOW, "r1", "41", "hang", "x: y z")]


@pytest.mark.parametrize("record", RECORDS, ids=repr)
def test_a_line_reads_back_as_its_record(record):
    assert type(record).parse(record.line()) == record
    assert type(record).parse(record.line() + "\n") == record
    others = {type(r) for r in RECORDS} - {type(record)}
    assert all(other.parse(record.line()) is None for other in others)


@pytest.mark.parametrize("line", [
    "slipway-hang rank=1 host=n step=3 idle=1.0 answered=late",  # no limit
    "slipway-hang rank=one host=n step=3 idle=1.0 limit=2 answered=late",
    "slipway-save step=1 ms=2 bytes=3 step_ms=4",
    "slipway-saves step=1 ms=2 bytes=3 step_ms=4 at=t",
    f"slipway-bad-node node=nid7 since={NOW} at={NOW} run=r job=4 kind=hang",  # no reason
    f"slipway-bad-node node=nid7 since=yesterday at={NOW} run=r job=4 kind=hang reason: x",
    f"slipway-bad-node node=nid$7 since={NOW} at={NOW} run=r job=4 kind=hang reason: x",
    "", "   ",
])
def test_a_damaged_line_is_no_record(line):
    assert all(kind.parse(line) is None for kind in (SaveLine, HangLine, BadNode))


def test_the_written_words():
    assert HangLine(3, "n", 9, 61.04, 20.0, on_time=False).line() == \
        "slipway-hang rank=3 host=n step=9 idle=61.0 limit=20 answered=late"
    assert SaveLine(1, 2, 3, 4, "t").line() == "slipway-save step=1 ms=2 bytes=3 step_ms=4 at=t"


def test_a_record_is_appended_whole_and_a_fifo_in_its_place_never_blocks(tmp_path):
    """The writer of every tagged line and event (common/fs.py append_line): whole lines, one each;
    a FIFO where the file should be (rank 0's record of a save, say) is an error at once, which the
    caller reports, never a training stuck on an open with no reader."""
    import os
    import signal

    path = tmp_path / "saves.log"
    for record in RECORDS[:2]:
        record.append_to(path)
    assert [type(r).parse(line) for r, line in zip(RECORDS, path.read_text().splitlines(keepends=True))] == RECORDS[:2]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def blocked(*_):
        raise RuntimeError("append_to blocked on a FIFO")  # the test fails instead of hanging the suite

    before = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(30)
    try:
        with pytest.raises(OSError):
            RECORDS[0].append_to(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
