"""The secret policy: which names and values must never reach a file, a command line or a terminal.

One policy, used everywhere: the schema engine refuses what it finds in any config field
(common/schema.py), every message masks by it (common/errors.py), records of a command
line and dry runs mask by it, the code snapshot and the image's build context scan every file
they copy by it (containers/sources.py), and the user's own text (launch.pre_launch,
hand-written EDF files) is warned about by it. docs/secrets.md has the table of what it catches.

Three questions:
- a NAME looks like a secret's (`secret_name`): it is split into words (at `_`, `-`, `.`,
  case changes and digits; a name in no case's convention, `hF_tOkEn`, by its separators
  alone) and a word is a secret's (TOKEN, KEY, PASSWORD, PAT, SIG, ...), or holds one run
  together (APIKEY, PGPASSWORD, HFTOKEN); look-alikes are not (TOKENIZERS, MAX_TOKENS, AUTHOR,
  KEYBOARD, COMPASS, PASSES, SIGMA, PATH), nor a name for where a secret is kept
  (SSH_AUTH_SOCK, HF_TOKEN_PATH, PASSWORD_FILE);
- a TEXT holds a secret (`find_secrets`, what every message and record is masked by): a
  detector's shape (common/secret_shapes.py: detect-secrets' per-provider detectors and this
  field's own tokens), a URL carrying a password or a token, or a secret's name given a literal
  value (`NAME=value`, `--NAME value`, `"name": "value"`, `name: value` on a line of its own);
- a VALUE the user gave (a config value, an argument) is a secret (`find_values`): the above,
  or one of its words is random-looking by its kind (common/secret_shapes.py `judge_word`: a
  40-hex W&B key, a 64-hex key, an AWS secret key, a high-entropy string), a path, URL, name
  or digest aside; hex under a hash's name (`GIT_COMMIT=`, `--revision`) is a hash.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common import secret_shapes as shapes

# ---------------------------------------------------------------------------- names

# A name's words: runs of capitals (HF, API), capitalised or lower-case words (Token, token),
# digits; everything else (_ - . / space) separates.
_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")

# Words that name a secret on their own.
_SECRET_WORDS = frozenset({
    "TOKEN", "KEY", "KEYS", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS", "PASSPHRASE",
    "PWD", "PAT", "COOKIE", "COOKIES", "SIG", "SIGNATURE", "CREDENTIAL", "CREDENTIALS", "CRED", "CREDS",
    "AUTH", "OAUTH", "AUTHORIZATION", "AUTHORISATION", "PRIVATE", "DSN", "BEARER", "JWT", "SESSID",
    "SESSIONID", "APIKEY", "CONNSTR",
})
# Parts that make a longer word a secret's wherever they stand in it (PGPASSWORD, CLIENTSECRET).
_SECRET_PARTS = ("SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "COOKIE", "PRIVATE", "SESSID")
# Words ending in KEY or PASS that are ordinary English (an APIKEY, SSHKEY, PGPASS, SSHPASS is not).
_ORDINARY_ENDINGS = frozenset({
    "MONKEY", "TURKEY", "HOCKEY", "JOCKEY", "DONKEY", "WHISKEY", "LACKEY", "TURNKEY", "HOTKEY",
    "BYPASS", "COMPASS", "SURPASS", "ENCOMPASS", "TRESPASS", "OVERPASS", "UNDERPASS",
    "ASKPASS",  # GIT_ASKPASS, SSH_ASKPASS: the program that asks, not the password
})
# A name whose last word is one of these names where a secret is kept, not the secret
# (SSH_AUTH_SOCK, HF_TOKEN_PATH, MYSQL_PASSWORD_FILE, TOKEN_URL): its value is a place.
_PLACE_WORDS = frozenset({"FILE", "FILES", "PATH", "DIR", "SOCK", "SOCKET", "URL", "URI", "HOST", "PORT",
                          "ENDPOINT"})
# TOKEN in a language model's vocabulary: a count or a special token, not a credential
# (MAX_TOKEN, PAD_TOKEN, EOS_TOKEN_ID, TOKEN_COUNT).
_TOKEN_BEFORE = frozenset({"MAX", "MIN", "NUM", "N", "TOTAL", "PAD", "BOS", "EOS", "UNK", "SEP", "CLS", "MASK",
                           "SPECIAL", "START", "END", "STOP", "NEXT", "FIRST", "LAST", "PER"})
_TOKEN_AFTER = frozenset({"LEN", "LENGTH", "COUNT", "COUNTS", "LIMIT", "BUDGET", "ID", "IDS", "TYPE", "TYPES",
                          "DIM", "SIZE", "INDEX", "IDX", "EMBEDDING", "EMBEDDINGS", "LEVEL"})
# The shell's own working directories are no password (MYSQL_PWD is).
_ORDINARY_NAMES = frozenset({"PWD", "OLDPWD"})


def name_words(name: str) -> list[str]:
    """`name` split into upper-case words: `hfToken` -> HF TOKEN, `com.example.api-key2` -> COM
    EXAMPLE API KEY 2; a name in no case's convention by its separators alone: `hF_tOkEn` -> HF TOKEN."""
    if _IRREGULAR.search(name):
        return _SEPARATED.findall(name.upper())
    return [w.upper() for w in _WORDS.findall(name)]


# Case that follows no convention: case changing within a word (tOkEn, ToKeN, KeY) or a lone
# lower-case letter before a capital (hF). Such a name's case says nothing, its separators do.
_IRREGULAR = re.compile(r"[a-z][A-Z][a-z][A-Z]|[A-Z][a-z][A-Z](?![a-z])|(?<![A-Za-z])[a-z][A-Z](?![A-Z])")
_SEPARATED = re.compile(r"[A-Z]+|[0-9]+")


def _word_secret(word: str) -> Optional[str]:
    """What in one word makes it a secret's (upper case), or None."""
    if word in _SECRET_WORDS:
        return word
    for part in _SECRET_PARTS:
        if part in word:
            return part
    if word in _ORDINARY_ENDINGS:
        return None
    if word.endswith(("TOKEN", "KEY", "KEYS", "PASS")) and not word.startswith("KEY"):
        return next(e for e in ("TOKEN", "KEYS", "KEY", "PASS") if word.endswith(e))
    # AUTH anywhere (OAUTH2, AUTHTOKEN, AUTHENTICATION), but not AUTHOR, AUTHORS, AUTHORITY
    # (XAUTHORITY): AUTHORIZE and AUTHORISATION are secrets' words again.
    for m in re.finditer("AUTH", word):
        rest = word[m.end():]
        if not rest.startswith("OR") or rest.startswith(("ORIZ", "ORIS")):
            return "AUTH"
    return None


def secret_name(name: object) -> Optional[str]:
    """The word that makes `name` look like a secret's (upper case), or None for an ordinary
    name. Case, separators and camelCase do not matter: HF_TOKEN, hf-token, hfToken,
    com.example.hf_token and hF_tOkEn alike."""
    if not isinstance(name, str) or not name or name.upper() in _ORDINARY_NAMES:
        return None
    return _words_secret(name_words(name))


def _words_secret(words: list[str]) -> Optional[str]:
    if words and words[-1] in _PLACE_WORDS and len(words) > 1:
        return None
    for i, word in enumerate(words):
        found = _word_secret(word)
        if found is None:
            continue
        if found == "TOKEN" and word == "TOKEN" and (
                (i > 0 and words[i - 1] in _TOKEN_BEFORE) or (i + 1 < len(words) and words[i + 1] in _TOKEN_AFTER)):
            continue
        return found
    for first, second in zip(words, words[1:]):  # a connection string (AZURE_STORAGE_CONNECTION_STRING)
        if first in ("CONNECTION", "CONN") and second in ("STRING", "STR"):
            return "CONNECTION STRING"
    return None


# ---------------------------------------------------------------------------- values


@dataclass(frozen=True)
class Found:
    """A secret inside a text: the span to hide (`start`:`end`), what it looks like, and the name
    it was given (NAME=value), if any."""

    start: int
    end: int
    what: str
    name: Optional[str] = None


# A URL whose user part carries a password: scheme://user:PASSWORD@host (the password hidden),
# or is a token itself: https://TOKEN@host/... (judged as a value's word: a user name passes).
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,30}://[^\s/@:'\"]{0,200}:([^\s/@'\"]{1,500})@")
_URL_USER = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,30}://([^\s/@:'\"]{16,500})@")
# NAME=value (an sbatch --export list, an environment assignment, a URL's query; the value may
# be quoted), and a flag `--NAME value` (a command line): the value, where NAME looks like a secret's.
_NAME = r"(?<![A-Za-z0-9_.-])(-{0,2}[A-Za-z_][A-Za-z0-9_.-]{0,100})"
# (The values are read ahead, not taken, and end at the next `=` but for base64's padding:
# `A=B_TOKEN=x` holds two assignments, and no input makes the scan slower than linear.)
_ASSIGNMENT = re.compile(_NAME + r"""=(?=(?:"([^"\r\n]*)"|'([^'\r\n]*)'|([^\s,;&'"`)\]=]*=*)))""")
_FLAG = re.compile(r"(?<![A-Za-z0-9_.-])(--?[A-Za-z_][A-Za-z0-9_.-]{0,100})[ \t]+(?=([^-\s'\"`][^\s,;&'\"`)\]]*))")
# The same in the forms of files: `"name": "value"` (JSON), `name = "value"` (Python, TOML), and
# `name: value` alone on its line (YAML, .netrc-like): the value quoted, or the line's last word.
_QUOTED = re.compile(r"""["']?([A-Za-z_][A-Za-z0-9_.-]{0,100})["']?[ \t]*(?::|:=|=)[ \t]*(?=(?:"([^"\r\n]*)"|'([^'\r\n]*)'))""")
_LINE = re.compile(r"""(?m)^[ \t]*(?:-[ \t]+)?([A-Za-z_][A-Za-z0-9_.-]{0,100})[ \t]*:[ \t]+(?=([^\s'"#]+)[ \t]*$)""")
# A value that is no secret itself: a reference to a variable ($X, ${X}, $(command)), a
# placeholder (..., <hidden>), or a file's path (where a secret is kept).
_REFERENCE = re.compile(r"\$[({]?[A-Za-z_][A-Za-z0-9_]*(?::-[^}]*)?[)}]?|\$\(.*", re.S)
_PLACEHOLDER = re.compile(r"\.{3}|<[^<>]*>|\*+|[Xx]{3,}|value|VALUE")
_PATH = re.compile(r"(?:/|\./|\.\./|~/|\$\{[A-Za-z_][A-Za-z0-9_]*\}/|\$[A-Za-z_][A-Za-z0-9_]*/)[^\s=,;&'\"]*")


def is_literal(value: str) -> bool:
    """Whether `value` could be a secret itself, rather than empty, a reference to a variable, a
    placeholder or a file's path (GOOGLE_APPLICATION_CREDENTIALS=/keys/x.json names a place)."""
    return bool(value) and not (_REFERENCE.fullmatch(value) or _PLACEHOLDER.fullmatch(value)
                                or _PATH.fullmatch(value))


def find_secrets(text: str, code: bool = False) -> list[Found]:
    """Every secret-looking part of `text`, in order, overlapping ones merged: what any text is
    masked by (messages, records, dry runs, a job's output). `code`: `text` is a program's source,
    where a name is given a secret only as a quoted literal (`key=lambda ...` is code)."""
    if not isinstance(text, str) or not text:
        return []
    if len(text) <= _CACHED_LENGTH:  # a config's values, its messages: the same strings again and again
        return list(_find_secrets_cached(text, code))
    return _find_secrets(text, code)


# A sweep validates a thousand configs holding mostly the same values: each short text is judged once.
_CACHED_LENGTH = 2048


@functools.lru_cache(maxsize=16384)
def _find_secrets_cached(text: str, code: bool) -> tuple[Found, ...]:
    return tuple(_find_secrets(text, code))


def _find_secrets(text: str, code: bool) -> list[Found]:
    found = [Found(*span) for span in shapes.shape_spans(text)]
    for m in _URL_PASSWORD.finditer(text):
        if is_literal(m.group(1)) and not shapes.placeholder(m.group(1)):
            found.append(Found(m.start(1), m.end(1), "a URL with a password"))
    for m in _URL_USER.finditer(text):
        if shapes.judge_url_user(m.group(1)):
            found.append(Found(m.start(1), m.end(1), "a URL with a token as its user"))
    for m in _ASSIGNMENT.finditer(text):
        group = next(g for g in (2, 3, 4) if m.group(g) is not None)
        name, value = m.group(1).lstrip("-"), m.group(group)
        if secret_name(name) and is_literal(value) and (not code or (group != 4 and shapes.code_literal(value))):
            found.append(Found(m.start(group), m.end(group), f"a secret ({name}=...)", name))
    for m in () if code else _FLAG.finditer(text):
        name, value = m.group(1).lstrip("-"), m.group(2)
        if secret_name(name) and is_literal(value):
            found.append(Found(m.start(2), m.end(2), f"a secret ({m.group(1)} ...)", flag_variable(name)))
    for pattern in (_QUOTED,) if code else (_QUOTED, _LINE):
        for m in pattern.finditer(text):
            group = next(g for g in (2, 3) if m.group(g) is not None)
            name, value = m.group(1), m.group(group)
            if secret_name(name) and is_literal(value) and not shapes.placeholder(value) \
                    and (not code or shapes.code_literal(value)):
                found.append(Found(m.start(group), m.end(group), f"a secret (its name contains {secret_name(name)})",
                                   name))
    return _merged(found)


def _merged(found: list[Found]) -> list[Found]:
    found.sort(key=lambda f: (f.start, -f.end))
    merged: list[Found] = []
    for f in found:
        if merged and f.start < merged[-1].end:  # one secret seen twice (a token given as HF_TOKEN=...)
            last = merged[-1]
            merged[-1] = Found(last.start, max(last.end, f.end), last.what, last.name or f.name)
            continue
        merged.append(f)
    return merged


# A value's words: what lies between spaces, quotes, brackets and list separators; a word
# `NAME=value` is judged by its value, under its name.
_WORD = re.compile(r"[^\s'\"`,;()\[\]{}<>|]+")
_FLAG_WORD = re.compile(r"--?[A-Za-z][A-Za-z0-9_.-]*")


def find_values(text: str, hint: Optional[str] = None) -> list[Found]:
    """`find_secrets`, and each word of `text` that is random-looking by its kind (a key: 40 or
    64 hex digits, an AWS secret key, a high-entropy string; common/secret_shapes.py
    `judge_word`): for what the user gave (a config value, an argument, a command line), which
    no detector may read as a substring. `hint`: the name `text` is given under (a mapping's
    key, the flag before it): hex under a hash's name (GIT_COMMIT, --revision) is a hash."""
    if not isinstance(text, str) or not text:
        return []
    found = find_secrets(text)
    before = hint
    for m in _WORD.finditer(text):
        word, start = m.group(), m.start()
        name = before
        if "=" in word.rstrip("="):  # NAME=value (base64's padding is no assignment)
            name, _, rest = word.partition("=")
            start += len(name) + 1
            word = rest
        what = shapes.judge_word(word, _hash_named(name))
        if what:
            found.append(Found(start, start + len(word), what))
        before = m.group() if _FLAG_WORD.fullmatch(m.group()) else None
    return _merged(found)


def _hash_named(name: Optional[str]) -> bool:
    return bool(name) and any(w in shapes.HASH_WORDS for w in name_words(name))


def secret_shape(text: object) -> Optional[Found]:
    """The first secret-looking part of `text`, or None."""
    found = find_secrets(text) if isinstance(text, str) else []
    return found[0] if found else None


HIDDEN = "<hidden>"


def mask(text: str, values: bool = False) -> str:
    """`text` with every secret-looking part replaced by <hidden>: what any message, record of
    a command line or dry run shows instead. `values`: `text` is what the user gave (a command
    line, a value quoted in a message), judged word by word too (`find_values`)."""
    if not isinstance(text, str) or not text:
        return text
    found = find_values(text) if values else find_secrets(text)
    if not found:
        return text
    out, pos = [], 0
    for f in found:
        out += [text[pos:f.start], HIDDEN]
        pos = f.end
    out.append(text[pos:])
    return "".join(out)


# ---------------------------------------------------------------------------- what a config may hold


def expanded_names(text: str, edf: bool = False) -> list[str]:
    """The variables `text` expands: `${NAME}` and `${NAME:-default}`; in EDF text (`edf`), not
    after a `$$`, which is a literal `$` there."""
    names, i = [], 0
    while True:
        j = text.find("$", i)
        if j < 0 or j + 1 >= len(text):
            return names
        if edf and text[j + 1] == "$":
            i = j + 2
            continue
        m = _EXPANSION.match(text, j)
        if m:
            names.append(m.group(1))
        i = j + 1


_EXPANSION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")

# What a field lets through besides the ordinary (a field's metadata {"secrets": ...}):
REFUSE = "refuse"  # no secret-looking value, no expansion of a secret-looking variable
PASSTHROUGH = "passthrough"  # container.env: NAME = "${NAME}", the host's own variable, is allowed
REFERENCE = "reference"  # container.annotations: a value that is one ${VAR}, expanded as the container starts
OWN_TEXT = "own text"  # launch.pre_launch: the user's own shell lines, warned about (`warning`), never refused


@dataclass(frozen=True)
class Refusal:
    """Why a config value may not be written down: what it looks like, and the variable to pass
    by name instead."""

    what: str
    variable: str
    expansion: bool = False
    policy: str = REFUSE

    def message(self) -> str:
        """The one line a refusal says after its field: what it saw, never the value, and the
        pass-through form."""
        if self.policy == REFERENCE and not self.expansion:  # an annotation: the Container Engine expands it
            return (f"looks like {self.what}, and a value given here is written into env.toml: export it in the "
                    f"shell you submit from (`export {self.variable}=...`), write the value as "
                    f"\"${{{self.variable}}}\" (expanded as the container starts) and list it in "
                    f"container.env_from_host: [{self.variable}]")
        if self.expansion:
            return (f"expands ${{{self.variable}}}, which looks like a secret: a command line holding it could be "
                    f"printed (launch.debug's set -x, a dry run): pass the variable itself with "
                    f"container.env_from_host: [{self.variable}] and build the value in the job")
        return (f"looks like {self.what}, and a value given here is written into the run directory (or the image) "
                f"and could be printed: export it in the shell you submit from (`export {self.variable}=...`) and "
                f"pass it by name: container.env_from_host: [{self.variable}]")


def refusal(value: object, *, name: Optional[str] = None, policy: str = REFUSE,
            edf: bool = False, hint: Optional[str] = None) -> Optional[Refusal]:
    """Why a config value may not be written into a file or a command line, or None. `name`: the
    mapping key it is given under (an environment variable, a build arg, an annotation), whose
    value must be empty or a file's path if the name looks like a secret's (the pass-through
    forms of `policy` aside); `edf`: the value is EDF text (`$$` is a literal `$`); `hint`: the
    flag before it in a list (`--revision`), which tells a hash from a key (`find_values`)."""
    if policy == OWN_TEXT or not isinstance(value, str):
        return None
    if name is not None and secret_name(name) and value and not _PATH.fullmatch(value):
        own = policy == PASSTHROUGH and value == f"${{{name}}}"
        single = policy == REFERENCE and _EXPANSION.fullmatch(value) is not None
        if not own and not single:
            return Refusal(f"a secret (its name contains {secret_name(name)})", _variable(name), policy=policy)
    found = find_values(value, hint=name or hint)
    if found:
        return Refusal(found[0].what, _variable(found[0].name or name or "NAME"), policy=policy)
    whole = _EXPANSION.fullmatch(value)
    for ref in expanded_names(value, edf):
        allowed = (policy == PASSTHROUGH and ref == name and value == f"${{{ref}}}") or \
                  (policy == REFERENCE and whole is not None)
        if secret_name(ref) and not allowed:
            return Refusal(f"an expansion of ${{{ref}}}", ref, expansion=True)
    return None


def _variable(name: str) -> str:
    """An environment variable's name for the pass-through form: the name itself where it is one
    (hf_token), else made one (HF_TOKEN from com.example.hf_token or x-hf-token)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return name
    return flag_variable(name.split(".")[-1])


def flag_variable(flag: str) -> str:
    """The environment variable a command-line flag's secret would travel in: --hf-token, --hfToken ->
    HF_TOKEN."""
    text = "_".join(name_words(flag)) or "NAME"
    return "_" + text if text[0].isdigit() else text


def warning(value: object) -> Optional[str]:
    """For the user's own text (launch.pre_launch, a hand-written EDF): what a secret-looking part
    of it looks like, or None. Such text is written as it is; this is said, never the value."""
    found = secret_shape(value)
    return found.what if found else None


# ---------------------------------------------------------------------------- files

# File names that hold secrets by convention: private keys, credential, token and password files,
# env files, cluster and registry logins (what a code snapshot or an image must never copy,
# containers/sources.py). A file of any name is scanned whole by content too (`secret_content`).
_SECRET_FILE = re.compile(
    r"(id_(rsa|dsa|ecdsa|ed25519)|.*\.(pem|key|p12|pfx|jks|keystore|ppk|kdbx)"
    r"|(.*[._-])?credentials?([._-].*)?|client_secret.*\.json|.*service[._-]?account.*\.json"
    r"|(.*[._-])?tokens?(\.(json|txt|ya?ml))?|.*\.token|\.?netrc|_netrc|\.pgpass|\.pypirc|\.npmrc"
    r"|\.git-credentials|\.?htpasswd|\.env(\..*)?|.*\.env|\.envrc"
    r"|(.*[._-])?secrets?(\.(ya?ml|json|toml|txt|ini|cfg|conf))?|(.*[._-])?passw(or)?ds?(\.\w+)?"
    r"|(.*[._-])?api[._-]?keys?(\.\w+)?|(.*[._-])?kubeconfig(\.\w+)?|\.dockercfg|\.dockerconfigjson)",
    re.IGNORECASE)
# Source code is judged by its content alone (credentials.py, secrets.py are modules).
_SOURCE = (".py", ".pyi", ".sh", ".md", ".rst")
# Programs, where `name=value` unquoted is code (a keyword argument, a variable), not a literal.
_CODE_SUFFIXES = (".py", ".pyi", ".pyx", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".js", ".ts", ".go", ".rs",
                  ".java", ".scala", ".jl", ".r", ".lua", ".ipynb")


def secret_file(name: str) -> Optional[str]:
    """What makes a file's name a secret file's (a key, credentials, a token, password or env
    file, a kubeconfig; never a source file), or None."""
    if name and _SECRET_FILE.fullmatch(name) and not name.endswith(_SOURCE):
        return "its name is a secret file's (a key, credentials, a token, password or env file)"
    return None


def secret_content(data: bytes, name: str = "") -> Optional[str]:
    """What a file's whole content holds that looks like a secret (`find_secrets`, and
    detect-secrets' keyword rules for the file's type, `name`), with its line; None. Read as
    bytes, whatever their encoding: a token is ASCII in any of them."""
    if data[:2] == b"\x1f\x8b":  # gzip: past its header (a name, a comment) no text survives compression
        data = data[:1024]
    # UTF-16 (a Windows editor's, a PowerShell export) spreads a token's letters apart: read as such.
    encoding = "utf-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else "latin-1"
    text, code = data.decode(encoding, "replace"), name.endswith(_CODE_SUFFIXES)
    spans = [(f.start, f.what) for f in find_secrets(text, code)[:1]]
    spans += [(start, what) for start, _, what in shapes.keyword_spans(text, name, code)][:1]
    if not spans:
        return None
    start, what = min(spans)
    return f"it holds {what}, line {text.count(chr(10), 0, start) + 1}"


@functools.lru_cache(maxsize=1)
def policy_fingerprint() -> str:
    """What decides a file's scan: this policy's own code and the detector library's version. A
    record of files found clean holds for the policy of the same fingerprint only."""
    digest = hashlib.sha256(shapes.library()[3].encode())
    for module in (__file__, shapes.__file__):
        digest.update(Path(module).read_bytes())
    return digest.hexdigest()[:16]
