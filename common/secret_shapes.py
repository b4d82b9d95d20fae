"""What a secret's value looks like: the detectors under the secret policy (common/secrets.py).

Three sources, each giving spans of a text (start, end, what):
- detect-secrets (Yelp's maintained secret scanner, pure Python): every per-provider detector it
  lists (AWS, GitHub, GitLab, Slack, Stripe, JWT, private keys, basic-auth URLs, Azure, Twilio,
  SendGrid, ...) as it applies them (`analyze_string`), its keyword rules for source files, and
  its high-entropy detectors' charsets and limits for whole values (`judge_word`). A detector a
  new release adds is used with no change here. Loaded on first use, once per process.
- this field's tokens the library does not know (SHAPES): Hugging Face, NGC, W&B, Databricks,
  OpenAI and Anthropic, Google, fine-grained GitHub, npm, PyPI, bearer credentials, HTTP headers,
  whole PEM blocks, and base64 of `user:password` (docker's config.json `auth`, `Basic ...`).
- whole words judged by their kind (`judge_word`): entropy detectors flag paths, words and
  hashes when used on substrings, so a word is judged whole, and only when it is none of a path,
  a URL, a name (`meta-llama/Llama-3.1-8B`, `llama-8b-lr3e-4`) or a digest (`sha256:...`).
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
import os
import re
import string
from typing import Callable, Iterator, Optional

Span = tuple[int, int, str]

# ---------------------------------------------------------------------------- this field's own


# Well-known formats the library does not know, each bounded so that a scan stays linear on any
# input. A pattern with a group hides the group alone (a header's value, not its name).
SHAPES: list[tuple[str, re.Pattern]] = [(what, re.compile(pattern)) for what, pattern in [
    ("a Hugging Face token", r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{20,}"),
    ("an NGC API key", r"(?<![A-Za-z0-9])nvapi-[A-Za-z0-9_-]{20,}"),
    ("a W&B API key", r"(?<![A-Za-z0-9])local-[0-9a-f]{40}(?![0-9a-f])"),
    ("a Databricks token", r"(?<![A-Za-z0-9])dapi[0-9a-f]{32}(?:-[0-9]+)?(?![0-9a-f])"),
    ("a GitHub token", r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
    ("a Google API key", r"(?<![A-Za-z0-9])AIza[A-Za-z0-9_-]{35}"),
    ("a Slack token", r"(?<![A-Za-z0-9])xox[abposr]-[A-Za-z0-9-]{10,}"),
    ("an OpenAI or Anthropic key", r"(?<![A-Za-z0-9_-])sk-[A-Za-z0-9_-]{0,40}?[A-Za-z0-9_]{20}[A-Za-z0-9_-]*"),
    ("a Stripe key", r"(?<![A-Za-z0-9])[rs]k_(?:live|test)_[A-Za-z0-9]{16,}"),
    ("an npm token", r"(?<![A-Za-z0-9])npm_[A-Za-z0-9]{30,}"),
    ("a PyPI token", r"(?<![A-Za-z0-9])pypi-AgE[A-Za-z0-9_-]{30,}"),
    ("a JSON web token", r"(?<![A-Za-z0-9])eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"),
    ("a private key", r"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----(?:[^-]|-(?!----END))*"
                      r"(?:-----END [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----)?"),
    ("a bearer token", r"(?<![A-Za-z0-9])[Bb]earer[ \t]+[A-Za-z0-9._~+/-]{16,}=*"),
    ("an HTTP credential header", r"(?i)(?<![A-Za-z0-9_.-])(?:proxy-)?(?:authorization|cookie|set-cookie|x-api-key|"
                                  r"api-key|x-auth-token|private-token)[ \t]*:[ \t]*([^\s'\"][^\r\n'\"]{7,})"),
]]
# A base64 word: checked for `user:password` inside (docker's auth, HTTP Basic, NGC's legacy keys).
_BASE64_WORD = re.compile(r"(?<![A-Za-z0-9+/])[A-Za-z0-9+/]{8,}=*(?![A-Za-z0-9+/])")
_CREDENTIAL = re.compile(rb"[\x21-\x7e]{1,256}:[\x21-\x7e]{1,1024}")


def base64_credentials(text: str) -> Iterator[Span]:
    """Each base64 word of `text` that decodes to printable `user:password` (a `/` or `+` the
    text puts around or into it, both base64's letters, tried without)."""
    for m in _BASE64_WORD.finditer(text):
        word = m.group().rstrip("=")
        for core in dict.fromkeys((word, word.strip("+/"), *(w for w in re.split("[+/]", word) if len(w) >= 8))):
            pad = -len(core) % 4  # padding as it should be, whatever follows (`auth=...=`)
            if pad == 3:
                continue
            try:
                raw = base64.b64decode(core + "=" * pad, validate=True)
            except (binascii.Error, ValueError):
                continue
            if _CREDENTIAL.fullmatch(raw):
                yield m.start(), m.end(), "base64 of a user:password (a docker or HTTP Basic credential)"
                break


# ---------------------------------------------------------------------------- the library


Detector = tuple[str, Callable[[str], Iterator[str]], tuple[re.Pattern, ...]]


@functools.lru_cache(maxsize=1)
def library() -> tuple[list[Detector], object, object, str]:
    """detect-secrets' per-provider detectors as (what, analyze_string, its regexes), its base64
    and hex entropy detectors, and its version; ([], None, None, "") where it is not installed
    (an image built before slipway depended on it: the trainer's own messages are then masked by
    SHAPES alone; the host always has it)."""
    try:
        from detect_secrets.__version__ import VERSION
        from detect_secrets.core.plugins.util import get_mapping_from_secret_type_to_class
        from detect_secrets.plugins.base import RegexBasedDetector
        from detect_secrets.plugins.high_entropy_strings import Base64HighEntropyString, HexHighEntropyString
    except ImportError:
        return [], None, None, ""
    detectors = []
    for what, cls in sorted(get_mapping_from_secret_type_to_class().items()):
        # A public IP address names a machine, not a credential; entropy and keywords: below.
        if issubclass(cls, RegexBasedDetector) and cls.__name__ != "IPPublicDetector":
            detector = cls()
            detectors.append((f"a secret by detect-secrets ({what})", detector.analyze_string, tuple(detector.denylist)))
    return detectors, Base64HighEntropyString(), HexHighEntropyString(), VERSION


def library_spans(text: str) -> Iterator[Span]:
    """Where the library's provider detectors find a secret in `text`: the whole match of each
    of a detector's regexes that holds a value the detector yields (its own checks, a JWT's
    decoding, decide; the value it yields may be a part only, a token's prefix)."""
    for what, analyze, patterns in library()[0]:
        values = [v for v in analyze(text) if v and not placeholder(v)]
        if not values:
            continue
        for pattern in patterns:
            for m in pattern.finditer(text):
                if any(v in m.group() for v in values):
                    yield m.start(), m.end(), what


def shape_spans(text: str) -> Iterator[Span]:
    """Every span the library's detectors and this field's own shapes find in `text`."""
    for what, pattern in SHAPES:
        for m in pattern.finditer(text):
            yield (*m.span(m.lastindex or 0), what)
    yield from base64_credentials(text)
    yield from library_spans(text)


# A value that stands for a secret without being one: `...`, `<hidden>`, `***`, `xxx`, `value`,
# a template's `{}` or `%s`, a short word in capitals (`scheme://user:PASSWORD@host` in a comment).
_PLACEHOLDER = re.compile(r"\.{3}|<[^<>]*>|\*+|[Xx]{3,}|value|VALUE|\{[^{}]*\}|%s|[A-Z][A-Z_]{0,15}")


def placeholder(value: str) -> bool:
    return bool(_PLACEHOLDER.fullmatch(value))


# ---------------------------------------------------------------------------- whole words

# A word's kind, told by the name it is given under (GIT_COMMIT=..., --revision ...): a hash.
HASH_WORDS = frozenset({"COMMIT", "SHA", "SHA1", "SHA256", "SHA512", "REV", "REVISION", "HASH", "DIGEST",
                        "CHECKSUM", "MD5", "REF", "ETAG"})
_DIGEST = re.compile(r"(?:sha(?:1|224|256|384|512)|md5|blake2b?):[0-9a-fA-F]{32,128}")
_HEX = re.compile(r"[0-9a-fA-F]{32,}")
# A name: parts between - _ . that are each a word, a number, or short (llama-8b-lr3e-4).
_NAME_PART = re.compile(r"[a-z]+|[A-Z][a-z]*|[A-Z]+|[0-9]+|.{1,12}", re.S)
_AWS_SECRET = re.compile(r"[A-Za-z0-9/+]{40}")
B64_CHARS = frozenset(string.ascii_letters + string.digits + "+/-_=")


@functools.lru_cache(maxsize=16384)  # a sweep's configs hold the same words again and again
def judge_word(word: str, hash_named: bool = False) -> Optional[str]:
    """What a whole word (no spaces: a config value, an argument, an assignment's value) looks
    like when it looks like a key by its kind and randomness, or None. Paths, URLs (their
    credentials are shapes), names, digests, and hex under a hash's name pass."""
    if len(word) < 20 or "://" in word or _DIGEST.fullmatch(word):
        return None
    _, b64, hexa, _ = library()
    limit = b64.entropy_limit if b64 else 4.5
    entropy = b64.calculate_shannon_entropy(word) if b64 else _entropy(word, B64_CHARS)
    if word.startswith("/") and _top_dir(word.split("/")[1]):
        return None  # an absolute path under a directory this machine has (/run, /scratch): a place
    if _AWS_SECRET.fullmatch(word) and _classes(word) == 3 and (
            entropy > limit or (entropy > _AWS_LIMIT and _changes(word) >= 0.5)):
        # AWS's own format (40 base64 characters, `/` and `+` among them) is judged closer than any
        # word: three classes of characters, a class change at every other one (a name or a path
        # changes once a word) and an entropy a little below the library's limit, as 2% of keys have.
        return "an AWS secret access key (40 random base64 characters)"
    if "/" in word and set(word) <= B64_CHARS:  # a path or a hub name, unless base64 through and through: between
        # its slashes the class of character changes at almost every other one (a name's, once a word)
        parts = [part for part in word.split("/") if len(part) >= 4]
        changes = sum(_changes(part) * (len(part) - 1) for part in parts) / max(sum(len(p) - 1 for p in parts), 1)
        if len(word) >= 32 and not set(word) & set("-_.") and _classes(word) == 3 and entropy > limit \
                and changes >= 0.4:
            return "a random-looking string (base64: an API key or password)"
        return None
    if word[0] in "/.~$%" or "/" in word:  # a path, a variable
        return None
    if _HEX.fullmatch(word):
        if hash_named or word.isdigit():  # a hash by its name; a number
            return None
        entropy = hexa.calculate_shannon_entropy(word) if hexa else _entropy(word, string.hexdigits)
        if entropy > (hexa.entropy_limit if hexa else 3.0):
            return (f"{len(word)} random hex digits (a key: W&B's are 40; a commit or digest is given under a name "
                    "that says so, e.g. GIT_COMMIT=, --revision, sha256:)")
        return None
    if not set(word) <= B64_CHARS:
        return None
    if all(_NAME_PART.fullmatch(part) for part in re.split(r"[-_.]+", word) if part):
        return None  # a name made of words and numbers: llama3-8b-instruct-lr3e-5-bs256
    if entropy > limit and _mixed(word):
        return "a random-looking string (an API key or password)"
    return None


def judge_url_user(user: str) -> Optional[str]:
    """What the user part of a URL (`https://USER@host`) looks like, when a token: judged as a
    word, and closer, as a long user name is rare and a token's place: 20 characters or more
    whose class of character (lower, upper, digit) changes at least every 2.5 characters within
    its parts, as a random key's does at 62% of them and a name's (MaryJaneWatsonParker,
    ci-runner-Project42Deploy) at a third or less. The word's entropy limit alone missed one
    random 40-character token in ten; this misses 1 in 5,000 (3% at 20 characters)."""
    found = judge_word(user)
    if found or len(user) < 20 or not set(user) <= B64_CHARS or not _mixed(user):
        return found
    parts = [part for part in re.split(r"[-_.]+", user) if len(part) > 1]
    changes = sum(_changes(part) * (len(part) - 1) for part in parts) / max(sum(len(p) - 1 for p in parts), 1)
    return "a random-looking string (a token)" if changes >= 0.4 else None


@functools.lru_cache(maxsize=256)
def _top_dir(name: str) -> bool:
    return bool(name) and os.path.isdir(f"/{name}")


_AWS_LIMIT = 4.2
_CLASSES = (string.ascii_lowercase, string.ascii_uppercase, string.digits)


def _class(c: str) -> int:
    return next((i for i, cls in enumerate(_CLASSES) if c in cls), 3)


def _classes(word: str) -> int:
    return len({_class(c) for c in word} - {3})


def _changes(word: str) -> float:
    """How often the class of character (lower, upper, digit, other) changes from one to the next."""
    return sum(_class(a) != _class(b) for a, b in zip(word, word[1:])) / max(len(word) - 1, 1)


def _mixed(word: str) -> bool:
    return _classes(word) >= 2


def _entropy(data: str, charset) -> float:
    return -sum(p * math.log2(p) for p in (data.count(c) / len(data) for c in set(charset)) if p > 0)


# ---------------------------------------------------------------------------- files


@functools.lru_cache(maxsize=1)
def _keywords() -> tuple[Optional[re.Pattern], Optional[Callable[[str, str], Iterator[str]]]]:
    """The library's keyword detector for source files: a quick test that a line names one of its
    keywords, and the detector with its rules for the file's type."""
    try:
        from detect_secrets.plugins import keyword
        from detect_secrets.util.filetype import determine_file_type
    except ImportError:
        return None, None
    detector = keyword.KeywordDetector()

    def analyze(line: str, filename: str) -> Iterator[str]:
        rules = keyword.REGEX_BY_FILETYPE.get(determine_file_type(filename),
                                              keyword.QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP)
        return detector.analyze_string(line, rules)

    return re.compile("|".join(keyword.DENYLIST), re.IGNORECASE), analyze


# A keyword's value that is code, not a literal: a call, an index, an attribute, a variable, a
# path, a constant (`password = os.environ["X"]`, `key: ${X}`, `token = None`).
_CODE = re.compile(r"[\w.]*[(\[].*|\$.*|[/~.].*|\w+(?:\.\w+)+|self|None|True|False|null|true|false|\d+")


# A string in a program that is a word, not a credential: `key = "start"`, `MODEL_KEY = "model"`.
_PLAIN = re.compile(r"[a-z_]+|[A-Z_]+|[A-Z][a-z]+|.{0,5}", re.S)


def code_literal(value: str) -> bool:
    """Whether a quoted string given to a secret's name in a program could be the secret: one
    word, at least 6 characters, not a plain word (`key = "start"` is no secret)."""
    return not _PLAIN.fullmatch(value) and not any(c.isspace() for c in value)


def keyword_spans(text: str, filename: str, code: bool = False) -> Iterator[Span]:
    """The library's keyword rules (`password = "..."` in Python, `api_key: ...` in YAML) on each
    line of a file that holds one of its keywords; `code`: a program's source (`code_literal`)."""
    quick, analyze = _keywords()
    if quick is None or analyze is None:
        return
    done = -1
    for m in quick.finditer(text):
        start = text.rfind("\n", 0, m.start()) + 1
        if start <= done:
            continue
        end = text.find("\n", m.end())
        done = end = len(text) if end < 0 else end
        line = text[start:end]
        for value in analyze(line, filename):
            if value and not placeholder(value) and not _CODE.fullmatch(value.strip()) \
                    and (not code or code_literal(value)):
                at = line.find(value)
                yield start + at, start + at + len(value), "a secret (a keyword given a value, detect-secrets)"
