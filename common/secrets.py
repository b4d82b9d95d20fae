"""The secret policy (docs/secrets.md): what must never reach a file, a command line or a terminal,
judged by detect-secrets and slipway's plugins (common/secret_plugins.py): every message is masked
by them (`mask`), a config value judged by what its field holds (`refusal`), a copied file by its
name or detect-secrets' own scan (`file_findings`). A project accepts what the detector gets wrong
by its conventions (common/baseline.py).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


def plugins():
    """common/secret_plugins.py, imported at the first scan rather than with this module: it loads
    detect-secrets (about 90 ms of CPU), which a command or a rank that scans nothing never pays."""
    from common import secret_plugins

    return secret_plugins


@dataclass(frozen=True)
class Found:
    """A secret inside a text: the span to hide, what it looks like, and the name it was given."""

    start: int
    end: int
    what: str
    name: Optional[str] = None


@functools.lru_cache(maxsize=1)
def detectors() -> tuple:
    """detect-secrets' per-provider plugins (but its public-IP one: an address names a machine)
    and slipway's; slipway's alone where detect-secrets is not installed (an old image)."""
    ours = tuple(cls() for cls in plugins().TEXT_PLUGINS)
    try:
        from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
        from detect_secrets.plugins.base import RegexBasedDetector
    except ImportError:
        return ours
    return tuple(cls() for cls in get_mapping_from_secret_type_to_class().values()
                 if issubclass(cls, RegexBasedDetector) and cls.__module__.startswith("detect_secrets.")
                 and cls.__name__ != "IPPublicDetector") + ours


def find_secrets(text: str) -> list[Found]:
    """Every secret-looking part of `text`, in order, overlapping ones merged: what any text is masked by."""
    if not isinstance(text, str) or not text or plugins().flag(text):  # a number or a flag holds no secret
        return []
    found, not_a_secret = [], plugins().not_a_secret
    for detector in detectors():
        for name, start, end in _hits(detector, text):
            if not not_a_secret(text[start:end]):
                what = f"a secret ({name.lstrip('-')}=...)" if name else f"a secret ({detector.secret_type})"
                found.append(Found(start, end, what, name))
    return _merged(found)


def _hits(detector: Any, text: str) -> list[tuple[Optional[str], int, int]]:
    """(name, start, end) of what `detector` finds: of slipway's, each value wherever it stands; of
    detect-secrets', a regex's match from the value it yields on (its own checks decide: a JWT must
    decode), to the match's end where the value is its start (GitHub's and GitLab's yield a prefix)."""
    pairs = list(detector.pairs(text)) if isinstance(detector, plugins().NamedValueDetector) \
        else [(None, value) for value in detector.analyze_string(text) if value and not plugins().not_a_secret(value)]
    if not pairs or not detector.__module__.startswith("detect_secrets."):
        return [(name, m.start(), m.end()) for name, value in pairs for m in re.finditer(re.escape(value), text)]
    return [(None, m.start() + at, m.end() if at == 0 else m.start() + at + len(value))
            for pattern in detector.denylist for m in pattern.finditer(text) for _, value in pairs
            if (at := m.group().find(value)) >= 0]


def _merged(found: list[Found]) -> list[Found]:
    found.sort(key=lambda f: (f.start, -f.end))
    merged: list[Found] = []
    for f in found:
        if merged and f.start < merged[-1].end:  # one secret seen twice (a token given as HF_TOKEN=...)
            last = merged[-1]
            merged[-1] = Found(last.start, max(last.end, f.end), last.what, last.name or f.name)
        else:
            merged.append(f)
    return merged


_WORD = re.compile(r"[^\s'\"`,;()\[\]{}<>|]+")  # a value's words; NAME=value is judged by its value


def find_values(text: str, hint: Optional[str] = None) -> list[Found]:
    """`find_secrets`, and each word that is a random key (`random_word`), which no detector finds in a
    longer text: for what the user gave. `hint`: the name `text` is given under (a key, the flag before it)."""
    if not isinstance(text, str) or not text:
        return []
    found, before = find_secrets(text), hint
    for m in _WORD.finditer(text):
        word, start, name = m.group(), m.start(), before
        if "=" in word.rstrip("="):  # NAME=value (base64's padding is no assignment)
            name, _, word = word.partition("=")
            start += len(name) + 1
        id_named = bool(name) and not plugins().ID_WORDS.isdisjoint(plugins().name_words(name))
        if what := plugins().random_word(word, id_named):
            found.append(Found(start, start + len(word), what))
        before = m.group() if re.fullmatch(r"--?[A-Za-z][A-Za-z0-9_.-]*", m.group()) else None
    return _merged(found)


ACCEPTED: set[str] = set()  # values a project accepted (common/baseline.py): never shown all the same


def mask(text: str, values: bool = False) -> str:
    """`text` with every secret-looking part replaced by <hidden>. `values`: `text` is what the user gave
    (a command line, a value quoted in a message), judged word by word too (`find_values`)."""
    if not isinstance(text, str) or not text:
        return text
    found = find_values(text) if values else find_secrets(text)
    if ACCEPTED:
        found = _merged(found + [Found(m.start(), m.end(), "") for v in ACCEPTED
                                 for m in re.finditer(re.escape(v), text)])
    out, pos = [], 0
    for f in found:
        out += [text[pos:f.start], "<hidden>"]
        pos = f.end
    return "".join(out) + text[pos:]


# ---------------------------------------------------------------------------- what a config may hold

# What a field holds (its metadata {"secrets": ...}), which says how its values are judged:
IDENTIFIER = "identifier"  # names, paths, revisions, images (the default): by the detectors' shapes alone
TEXT = "text"  # may carry a credential: also by the name it is given and each word's randomness
PASSTHROUGH = "passthrough"  # container.env: TEXT, and NAME = "${NAME}", the host's own variable
REFERENCE = "reference"  # container.annotations: TEXT, and one ${VAR}, expanded as the container starts
OWN_TEXT = "own text"  # launch.pre_launch: the user's own shell lines, warned about, never refused
EXPANSION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")  # EDF text's one expansion
# While a config file is read (common/baseline.py `accepting`): what its own conventions accept.
ACCEPTING: contextvars.ContextVar[Any] = contextvars.ContextVar("accepting", default=None)


@dataclass(frozen=True)
class Refusal:
    """Why a config value may not be written down, and its secret part (what a project may accept)."""

    what: str
    variable: str
    expansion: bool = False
    policy: str = IDENTIFIER
    secret: str = ""

    def message(self) -> str:
        """What it saw (never the value), the pass-through form, and how a config file may accept it."""
        if self.expansion:
            return (f"expands ${{{self.variable}}}, which looks like a secret: a command line holding it could be "
                    f"printed (launch.debug's set -x, a dry run): pass the variable itself with "
                    f"container.env_from_host: [{self.variable}] and build the value in the job")
        how = ACCEPTING.get().how(self.secret) if ACCEPTING.get() is not None else ""
        annotation = f", write the value as \"${{{self.variable}}}\" (expanded as the container starts)" \
            if self.policy == REFERENCE else ""
        return (f"looks like {self.what}, and a value given here is written into the run directory (or the image) "
                f"and could be printed: export it in the shell you submit from (`export {self.variable}=...`)"
                f"{annotation} and pass it by name: container.env_from_host: [{self.variable}]{how}")


def refusal(value: object, *, name: Optional[str] = None, policy: str = IDENTIFIER,
            edf: bool = False, hint: Optional[str] = None) -> Optional[Refusal]:
    """Why a config value may not be written into a file or a command line, or None. `name`: the key it
    is given under; `edf`: the value is EDF text (`$$` is a literal `$`); `hint`: the flag before it."""
    if policy == OWN_TEXT or not isinstance(value, str):
        return None
    text = policy != IDENTIFIER
    if name is None and hint and "=" not in hint and not value.startswith("-"):  # `--token VALUE` in a list
        name = hint.lstrip("-") if plugins().secret_name(hint.lstrip("-")) else None
    passed = policy == PASSTHROUGH and value == f"${{{name}}}" or policy == REFERENCE and EXPANSION.fullmatch(value)
    if text and name is not None and plugins().secret_name(name) and value and not plugins().is_path(value) \
            and not plugins().plain(value, name) and not passed:
        return Refusal(f"a secret (its name ends in {plugins().secret_name(name)})", _variable(name), policy=policy,
                       secret=value)
    found = find_values(value, hint=name or hint) if text else find_secrets(value)
    if found:
        return Refusal(found[0].what, _variable(found[0].name or name or "NAME"), policy=policy,
                       secret=value[found[0].start:found[0].end])
    for ref in EXPANSION.findall(value.replace("$$", "") if edf else value):
        if plugins().secret_name(ref) and not passed:
            return Refusal(f"an expansion of ${{{ref}}}", ref, expansion=True)
    return None


def accepted(found: Refusal) -> bool:
    """Whether the config file being read accepts `found` (common/baseline.py): if so, masked from then on."""
    accepting = ACCEPTING.get()
    if found.expansion or accepting is None or not accepting.accepts(found.secret):
        return False
    ACCEPTED.add(found.secret)
    return True


def _variable(name: str) -> str:
    """The environment variable for the pass-through form: the name where it is one, else made one."""
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else flag_variable(name.split(".")[-1])


def flag_variable(flag: str) -> str:
    """The variable a command-line flag's secret would travel in: --hf-token -> HF_TOKEN."""
    text = "_".join(plugins().name_words(flag)) or "NAME"
    return "_" + text if text[0].isdigit() else text


# ---------------------------------------------------------------------------- files

# Names that are credentials by definition (keys, credentials, token, password, .netrc, env files,
# a kubeconfig), but no template (.env.example) nor source (credentials.py): their content decides.
_SECRET_FILE = re.compile(
    r"id_(rsa|dsa|ecdsa|ed25519)|.*\.(pem|key|p12|pfx|jks|keystore|ppk|kdbx)|\.?netrc|_netrc|\.pgpass|\.?htpasswd"
    r"|(.*[._-])?(credentials?|secrets?|passw(or)?ds?|api[._-]?keys?)(\.\w+)?|\.git-credentials|client_secret.*\.json"
    r"|.*service[._-]?account.*\.json|token|.*\.token|kubeconfig|\.env(\.\w+)?|\.envrc", re.IGNORECASE)
_NO_SECRET_FILE = re.compile(r".*[._-](example|sample|template|tmpl|tpl|dist|defaults?)(\.\w+)?|.*\.(py|pyi|sh|md|rst)",
                             re.IGNORECASE)


def secret_file(name: str) -> Optional[str]:
    if name and _SECRET_FILE.fullmatch(name) and not _NO_SECRET_FILE.fullmatch(name):
        return "its name is a credential file's (a key, credentials, a token, password or env file)"
    return None


_RUN = re.compile(r"[\w+/-]{20,}=*")  # what any entropy plugin may judge: a quoted string, a value, a lone key


def file_findings(data: bytes, name: str) -> list:
    """The PotentialSecrets detect-secrets' own scan (its plugins, filters and allowlist, and ours)
    finds in a file's content, by line. Read as bytes whatever the encoding (a token is ASCII in any),
    and first as a whole: where no plugin has anything to look at, the slow line-by-line scan is skipped."""
    from detect_secrets.core.scan import scan_file
    from detect_secrets.filters.heuristic import is_non_text_file

    if is_non_text_file(name):  # an image, an archive, a lock file: detect-secrets' own list
        return []
    text = data.decode("utf-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else "latin-1", "replace")
    if not (find_secrets(text) or _keywords().search(text) or any(map(plugins().random_word, _RUN.findall(text)))):
        return []
    _configure()
    with tempfile.TemporaryDirectory(prefix="slipway-scan-") as tmp:
        path = Path(tmp) / name
        path.write_bytes(text.encode("ascii", "replace"))  # what a reader in any locale reads back
        return sorted(scan_file(str(path)), key=lambda s: s.line_number)


@functools.lru_cache(maxsize=1)
def _keywords() -> re.Pattern:
    from detect_secrets.plugins.keyword import DENYLIST

    return re.compile("|".join(DENYLIST), re.IGNORECASE)


@functools.lru_cache(maxsize=1)
def _configure() -> None:
    """detect-secrets' settings in this process: every plugin of its (but the public-IP one) and
    slipway's, its default filters and `not_a_secret`; never a verifier (no secret leaves the machine)."""
    from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class as mapping
    from detect_secrets.settings import configure_settings_from_baseline, get_filters, get_settings

    path = f"file://{plugins().__file__}"
    configure_settings_from_baseline({"plugins_used": [
        *({"name": cls.__name__} for cls in mapping().values() if cls.__name__ != "IPPublicDetector"),
        *({"name": cls.__name__, "path": path} for cls in plugins().PLUGINS)]})
    get_settings().filters[f"{path}::not_a_secret"] = {}
    mapping.cache_clear()
    get_filters.cache_clear()


@functools.lru_cache(maxsize=1)
def policy_fingerprint() -> str:
    """This policy's code and detect-secrets' version: a record of files found clean holds for it only."""
    from detect_secrets.__version__ import VERSION

    digest = hashlib.sha256(VERSION.encode())
    for module in (__file__, plugins().__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()[:16]
