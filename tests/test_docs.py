"""The documentation stays true: docs/config.md is what the schema's source generates, and
every link between README.md and docs/*.md points at a file that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import config_reference as reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and [text]: target, outside code: the target up to a space, ')' or '#'.
LINK = re.compile(r"\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def test_config_reference_is_fresh():
    diff = reference.stale_diff()
    assert not diff, (f"docs/config.md is stale (the config schema or its comments changed): run "
                      f"`{reference.COMMAND}`\n{diff}")


def test_every_config_key_has_a_meaning(monkeypatch):
    """The page is rendered from the fields' comments: a field without one stops it, naming the key."""
    reference.render()  # every key of today's schema has one
    monkeypatch.setattr(reference, "field_comments", lambda cls: {})
    with pytest.raises(ValueError, match=r"^run\.name has no `#` comment above its field in trainer\.config$"):
        reference.render()


def test_generator_command_writes_the_page(tmp_path):
    out = tmp_path / "config.md"
    done = subprocess.run([sys.executable, "-m", "tests.config_reference", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text == reference.render()
    assert "- **`slurm.max_retries`**: integer; default `2`." in text
    assert "- **`container.runtime`**: one of `edf`, `pyxis`, `none`; default `edf`." in text
    out.write_text(text.replace("default `2`", "default `3`"))
    check = subprocess.run([sys.executable, "-m", "tests.config_reference", "--check", "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True)
    assert check.returncode == 1 and "-- **`slurm.max_retries`**: integer; default `3`." in check.stdout
    assert reference.COMMAND in check.stderr


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [a or b for a, b in LINK.findall(text)]


def _anchors(page: Path) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation dropped, spaces as '-'."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_internal_links_point_at_files(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z][a-z+.-]*:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {', '.join(broken)}"


def test_readme_quick_start_is_make_local_and_make_test():
    readme = (ROOT / "README.md").read_text()
    first_block = FENCE.search(readme).group(0)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()[1:-1] if line.strip()]
    assert commands == ["make local", "make test"]


def test_the_exit_codes_page_says_each_exit_code_of_common_rundir():
    """A launch's exit codes (common/rundir.py's *_EXIT, less the command's own BUG_EXIT), each in
    docs/runs.md's table, and nothing else there."""
    from common import rundir

    section = (ROOT / "docs" / "runs.md").read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", section, re.MULTILINE))
    codes = {value for name, value in vars(rundir).items() if name.endswith("_EXIT") and name != "BUG_EXIT"}
    assert {int(code) for code in rows} == {0} | codes and all(rows.values()), rows
