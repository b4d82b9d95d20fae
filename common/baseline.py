"""What a project accepts that the secret policy's detector refuses, by the detector's own
conventions (detect-secrets'): a `pragma: allowlist secret` comment on the line, and the
project's `.secrets.baseline` at its top, made by `detect-secrets scan` and labelled by
`detect-secrets audit`: an entry audited as no secret is accepted; one not audited, or audited as
a secret, is not. A copied file is scanned by detect-secrets itself, which leaves pragma lines out
(common/secrets.py `file_findings`), then held to the baseline (containers/sources.py); a config
file's values are accepted here while it is read (`accepting`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
from pathlib import Path
from typing import Iterator, Optional

from common import secret_plugins
from common.errors import ConfigError, bounded_path
from common.fs import read_file
from common.secrets import ACCEPTING

BASELINE = ".secrets.baseline"
MAX_BYTES = 32 << 20


class Baseline:
    """What `detect-secrets audit` said of each finding, by file (relative to `root`, the project's
    top where the baseline lies) and the secret's hash (detect-secrets' own)."""

    def __init__(self, root: Path, labels: dict[tuple[str, str], Optional[bool]]):
        self.root, self.labels = root, labels

    @staticmethod
    @functools.lru_cache(maxsize=16)
    def of(root: Path) -> "Baseline":
        """The baseline at `root`, read once a process (none: an empty one); a ConfigError where
        detect-secrets could not read it (damaged, not a file, huge)."""
        from detect_secrets.core.secrets_collection import SecretsCollection

        try:
            found = read_file(root / BASELINE, MAX_BYTES)
            if found is None:
                return Baseline(root, {})
            collection = SecretsCollection.load_from_baseline(json.loads(found[0]))  # type: ignore[arg-type]
            return Baseline(root, {(file, secret.secret_hash): secret.is_secret for file, secret in collection})
        except (OSError, TypeError, ValueError, KeyError, AttributeError) as exc:
            why = getattr(exc, "strerror", None) or type(exc).__name__
            raise ConfigError(bounded_path(root / BASELINE), f"is not a baseline detect-secrets can read ({why}): "
                                                             f"make it again: {Baseline(root, {}).command()}") from None

    def label(self, file: Path, secret_hash: str) -> Optional[bool]:
        """False: audited as no secret; True: as a secret; None: not audited, or not there."""
        return self.labels.get((os.path.relpath(os.path.realpath(file), os.path.realpath(self.root)), secret_hash))

    def command(self) -> str:
        """The one command that records what the project's files hold by detect-secrets' scan (with
        slipway's plugins, which find what its own leave: a key alone on a line; never verifying a
        secret over the network) and audits it (with them: secret_plugins.py's `audit`)."""
        plugin = Path(secret_plugins.__file__)
        plugin = shlex.quote(str(plugin.relative_to(self.root) if self.root in plugin.parents else plugin))
        scan = f"detect-secrets scan --no-verify --plugin {plugin}"
        scan += f" --baseline {BASELINE}" if (self.root / BASELINE).exists() else f" > {BASELINE}"
        cd = "" if Path.cwd().resolve() == self.root.resolve() else f"cd {shlex.quote(str(self.root))} && "
        return f"{cd}{scan} && python3 -I {plugin} audit {BASELINE}"  # -I: not common/ on sys.path


@functools.lru_cache(maxsize=64)
class _Accepting:
    """What config file `path` accepts: values on a line detect-secrets' allowlist takes (a
    `# pragma: allowlist secret` on it, or `# pragma: allowlist nextline secret` above it), and
    values its project's baseline audited as no secret."""

    def __init__(self, path: Path, text: str):
        from detect_secrets.core.potential_secret import PotentialSecret
        from detect_secrets.filters.allowlist import is_line_allowlisted
        from detect_secrets.util.code_snippet import get_code_snippet

        self.path, self.lines = path, text.splitlines()
        self.allowed = [line for i, line in enumerate(self.lines, 1)
                        if is_line_allowlisted(str(path), line, get_code_snippet(self.lines, i))]
        top = next((d for d in path.resolve().parents if (d / BASELINE).exists() or (d / ".git").exists()), path.parent)
        self.baseline, self.hash = Baseline.of(top), PotentialSecret.hash_secret

    def accepts(self, secret: str) -> bool:
        return any(secret in line for line in self.allowed) or \
            self.baseline.label(self.path, self.hash(secret)) is False

    def how(self, secret: str) -> str:
        """Where the file holds `secret`, and the command that accepts that line."""
        number = next((i for i, line in enumerate(self.lines, 1) if secret and secret in line), None)
        shown = shlex.quote(os.path.relpath(self.path))
        return "" if number is None else (f" ({shown} line {number}; if it is no secret, accept the line: "
                                          f"`sed -i '{number}s/$/  # pragma: allowlist secret/' {shown}`)")


@contextlib.contextmanager
def accepting(path: Path) -> Iterator[None]:
    """While config file `path` is read, what it accepts passes the secret policy (common/schema.py);
    judged once a content (a sweep reads its points from one file)."""
    found = read_file(path, MAX_BYTES)
    token = ACCEPTING.set(_Accepting(path, found[0].decode("utf-8", "replace")) if found and found[0] else None)
    try:
        yield
    finally:
        ACCEPTING.reset(token)
