"""What a project accepts that the secret policy refuses, by detect-secrets' own conventions: a
`pragma: allowlist secret` comment on the line, and an entry of the project's `.secrets.baseline`
that `detect-secrets audit` labelled no secret. Copied files are held to it by containers/sources.py,
a config file's values while it is read (`accepting`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Iterator, Optional

from common.errors import ConfigError, bounded_path
from common.fs import read_file
from common.secrets import ACCEPTING, plugins

BASELINE = ".secrets.baseline"
MAX_BYTES = 32 << 20


@functools.lru_cache(maxsize=16)
def labels(root: Path) -> dict[tuple[str, str], Optional[bool]]:
    """What `detect-secrets audit` said of each finding of `root`'s baseline, by file (relative to
    `root`) and secret hash, read once a process: False, no secret; True, a secret; None, not audited."""
    from detect_secrets.core.secrets_collection import SecretsCollection

    try:
        found = read_file(root / BASELINE, MAX_BYTES)
        collection = SecretsCollection.load_from_baseline(json.loads(found[0])) if found else []  # type: ignore
        return {(file, secret.secret_hash): secret.is_secret for file, secret in collection}
    except (OSError, TypeError, ValueError, KeyError, AttributeError) as exc:
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise ConfigError(bounded_path(root / BASELINE), f"is not a baseline detect-secrets can read ({why}): make "
                                                         f"it again: {command(root)}") from None


def label(root: Path, file: Path, secret_hash: str) -> Optional[bool]:
    return labels(root).get((os.path.relpath(os.path.realpath(file), os.path.realpath(root)), secret_hash))


def command(root: Path, file: Optional[Path] = None) -> str:
    """The one command that scans the project with detect-secrets and slipway's plugins (never verifying a
    secret over the network) and audits it: a new baseline of `file`, or the baseline scanned again, labels kept."""
    plugin = Path(plugins().__file__)
    plugin = shlex.quote(str(plugin.relative_to(root) if root in plugin.parents else plugin))
    only = f" {shlex.quote(os.path.relpath(os.path.realpath(file), os.path.realpath(root)))}" if file else ""
    # The interpreter running slipway, which has detect-secrets (no venv need be active); -I: neither
    # the project's top nor common/ on sys.path, where a yaml.py would shadow the library's
    python = f"{shlex.quote(sys.executable or 'python3')} -I"
    scan = f"{python} -m detect_secrets scan --no-verify --plugin {plugin}"
    scan += f" --baseline {BASELINE}" if (root / BASELINE).exists() else f"{only} > {BASELINE}"
    cd = "" if Path.cwd().resolve() == root.resolve() else f"cd {shlex.quote(str(root))} && "
    return f"{cd}{scan} && {python} {plugin} audit {BASELINE}"


@functools.lru_cache(maxsize=64)
class _Accepting:
    """What config file `path` accepts: values on a line detect-secrets' allowlist takes (`# pragma:
    allowlist secret` on it, or `...nextline secret` above), and values its baseline audited as no secret."""

    def __init__(self, path: Path, text: str):
        from detect_secrets.core.potential_secret import PotentialSecret
        from detect_secrets.filters.allowlist import is_line_allowlisted
        from detect_secrets.util.code_snippet import get_code_snippet

        self.path, self.lines = path, text.splitlines()
        self.allowed = [line for i, line in enumerate(self.lines, 1)
                        if is_line_allowlisted(str(path), line, get_code_snippet(self.lines, i))]
        self.top = next((d for d in path.resolve().parents if (d / BASELINE).exists() or (d / ".git").exists()),
                        path.parent)
        self.hash = PotentialSecret.hash_secret

    def accepts(self, secret: str) -> bool:
        return any(secret in line for line in self.allowed) or label(self.top, self.path, self.hash(secret)) is False

    def how(self, secret: str) -> str:
        """Where the file holds `secret`, and the command that accepts that line."""
        number = next((i for i, line in enumerate(self.lines, 1) if secret and secret in line), None)
        shown = shlex.quote(os.path.relpath(self.path))
        return "" if number is None else (f" ({shown} line {number}; if it is no secret, accept the line: "
                                          f"`sed -i '{number}s/$/  # pragma: allowlist secret/' {shown}`)")


@contextlib.contextmanager
def accepting(path: Path) -> Iterator[None]:
    """While config file `path` is read, what it accepts passes the secret policy; judged once a
    content (a sweep reads its points from one file)."""
    found = read_file(path, MAX_BYTES)
    token = ACCEPTING.set(_Accepting(path, found[0].decode("utf-8", "replace")) if found and found[0] else None)
    try:
        yield
    finally:
        ACCEPTING.reset(token)
