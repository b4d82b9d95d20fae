"""What the repository holds: no core dump, no binary, no archive but the shipped corpus.

A slurmd of the test's local cluster once aborted with the checkout as its working
directory and its core dump was committed. Each tracked file is judged by its first
bytes (not its name), so a build product, image or dump is caught whatever it is called.
"""

from __future__ import annotations

import fnmatch
import subprocess

import pytest

from conftest import ROOT

# The archives slipway ships: the builtin corpus (trainer/assets, in the package data).
ALLOWED_ARCHIVES = ("trainer/assets/*.gz",)
# (offset, magic bytes, what such a file is)
ARCHIVE_MAGIC = [
    (0, b"\x1f\x8b", "gzip"),
    (0, b"PK\x03\x04", "zip (or wheel)"),
    (0, b"\xfd7zXZ\x00", "xz"),
    (0, b"BZh", "bzip2"),
    (0, b"(\xb5/\xfd", "zstd"),
    (0, b"7z\xbc\xaf'\x1c", "7z"),
    (0, b"Rar!", "rar"),
    (0, b"hsqs", "squashfs image"),
    (257, b"ustar", "tar"),
]
ET_CORE = 4  # ELF e_type of a core dump


def what_it_is(head: bytes) -> str | None:
    """A binary kind for a file starting with `head` (its first 512 bytes), None for anything else."""
    if head.startswith(b"\x7fELF"):
        little = head[5:6] != b"\x02"  # EI_DATA: 1 little-endian, 2 big-endian
        e_type = int.from_bytes(head[16:18], "little" if little else "big")
        return "core dump" if e_type == ET_CORE else "ELF binary"
    for offset, magic, kind in ARCHIVE_MAGIC:
        if head[offset:offset + len(magic)] == magic:
            return f"{kind} archive"
    return None


def tracked_files() -> list[str]:
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"not a git checkout: {r.stderr.decode().strip()}")
    return [f for f in r.stdout.decode().split("\0") if f]


def test_no_tracked_file_is_a_core_dump_binary_or_stray_archive():
    offenders = []
    for name in tracked_files():
        path = ROOT / name
        if path.is_symlink() or not path.is_file():  # a link's bytes are its target's; a deleted file has none
            continue
        with path.open("rb") as f:
            kind = what_it_is(f.read(512))
        if kind and not (kind.endswith("archive") and any(fnmatch.fnmatch(name, p) for p in ALLOWED_ARCHIVES)):
            offenders.append(f"{name}: {kind}")
    assert not offenders, ("tracked files that must not be committed (git rm --cached them; .gitignore keeps them "
                           "out): " + ", ".join(offenders))


@pytest.mark.parametrize("head, kind", [
    (b"\x7fELF\x02\x01\x01" + bytes(9) + (4).to_bytes(2, "little"), "core dump"),
    (b"\x7fELF\x02\x01\x01" + bytes(9) + (2).to_bytes(2, "little"), "ELF binary"),
    (b"\x7fELF\x01\x02\x01" + bytes(9) + (4).to_bytes(2, "big"), "core dump"),
    (b"\x1f\x8b\x08\x00", "gzip archive"),
    (bytes(257) + b"ustar\x0000", "tar archive"),
    (b"hsqs" + bytes(100), "squashfs image archive"),
    (b"#!/bin/bash\necho hi\n", None),
    (b"", None),
])
def test_kinds_are_told_by_their_bytes(head, kind):
    assert what_it_is(head) == kind
