"""The secret policy itself (common/secrets.py): which names and values look like a secret's, and
how every message masks them. The lists below are the contract docs/secrets.md states: names
and values users set every day pass; secrets by name (in every spelling) and by shape do not.
The command-line proofs are in test_secrets.py.
"""

from __future__ import annotations

import json
import secrets
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs.slurm.sections import NODE_PRESETS
from common.errors import ConfigError, bounded, shown
from common.secrets import (PASSTHROUGH, REFERENCE, find_secrets, mask, name_words, refusal, secret_name,
                            secret_shape)

# Names that hold a secret, as users and tools spell them.
SECRET_NAMES = [
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "API_KEY",
    "APIKEY", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "GITHUB_TOKEN", "GH_TOKEN",
    "GITHUB_PAT", "GH_PAT", "PAT", "NPM_TOKEN", "ACCESS_TOKEN", "REFRESH_TOKEN", "ID_TOKEN", "TOKEN", "KEY",
    "SECRET", "CLIENT_SECRET", "SECRET_KEY_BASE", "JWT_SECRET", "JWT", "PASSWORD", "DB_PASSWORD", "PGPASSWORD",
    "PASSWD", "DB_PASS", "SMTP_PASS", "PASS", "SSHPASS", "PASSPHRASE", "GPG_PASSPHRASE", "MYSQL_PWD",
    "COOKIE", "SESSION_COOKIE", "PHPSESSID", "SESSIONID", "SIG", "URL_SIG", "SIGNATURE", "CREDENTIALS",
    "GIT_CREDENTIALS", "CRED", "CREDS", "AUTH", "OAUTH_TOKEN", "AUTHORIZATION", "HTTP_AUTHORIZATION",
    "PROXY_AUTHORIZATION", "AUTHTOKEN", "AUTH_KEY", "X_AUTH_TOKEN", "PRIVATE_KEY", "SSH_PRIVATE_KEY", "DSN",
    "SENTRY_DSN", "DATABASE_DSN", "AZURE_STORAGE_CONNECTION_STRING", "BEARER", "BEARER_TOKEN", "NCCL_IB_PKEY",
    "HF_HUB_DISABLE_IMPLICIT_TOKEN", "TOKEN2", "S3_KEY",
]
# Names users set every day: none of them is refused, in any field.
ORDINARY_NAMES = [
    "TOKENIZERS_PARALLELISM", "TOKENIZER", "TOKENIZER_NAME", "MAX_TOKENS", "MAX_NEW_TOKENS", "NUM_TOKENS",
    "TOKENS_PER_BATCH", "MAX_TOKEN", "PAD_TOKEN_ID", "EOS_TOKEN", "BOS_TOKEN_ID", "TOKEN_COUNT", "AUTHOR",
    "AUTHORS", "AUTHOR_EMAIL", "XAUTHORITY", "NCCL_IB_HCA", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE",
    "NUM_PASSES", "PASSES", "PASSTHROUGH", "BYPASS_CACHE", "COMPASS_DIR", "GIT_ASKPASS", "KEYBOARD",
    "KEYBOARD_LAYOUT", "KEYWORDS", "KEYMAP", "MONKEY_PATCH", "SIGMA", "SIGNAL", "SIGTERM_TIMEOUT", "PATH",
    "LD_LIBRARY_PATH", "PYTHONPATH", "PATCH_SIZE", "PATIENCE", "PATTERN", "HF_HOME", "HF_HUB_OFFLINE",
    "HF_DATASETS_CACHE", "HF_ENDPOINT", "HF_HUB_ENABLE_HF_TRANSFER", "TRANSFORMERS_CACHE", "WANDB_PROJECT",
    "WANDB_ENTITY", "WANDB_MODE", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS",
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "PWD", "OLDPWD", "HOME", "USER", "SHELL", "SSH_AUTH_SOCK",
    "HF_TOKEN_PATH", "PASSWORD_FILE", "SECRETS_DIR", "TOKEN_URL", "DESKTOP_SESSION", "XDG_SESSION_TYPE",
    "XDG_SESSION_ID", "PRIVILEGED", "DATABASE_URL", "REDIS_URL", "SEQ_LEN", "DATASET", "TORCH_COMPILE",
    "PYTORCH_CUDA_ALLOC_CONF", "SLURM_JOB_ID", "MAX_JOBS", "FLASH_ATTN_VERSION", "SMOKE", "BASE_IMAGE",
    *(name for preset in NODE_PRESETS.values() for name, _ in preset.env),
]


def spellings(name: str) -> dict[str, str]:
    """`name` as people write it: HF_TOKEN, hf_token, hfToken, HfToken, hf-token, com.example.hf_token,
    HF_TOKEN_2."""
    words = name.split("_")
    return {
        "upper": name, "lower": name.lower(), "camel": words[0].lower() + "".join(w.capitalize() for w in words[1:]),
        "pascal": "".join(w.capitalize() for w in words), "kebab": name.lower().replace("_", "-"),
        "annotation": f"com.example.{name.lower()}", "digit": f"{name}_2",
    }


SPELLINGS = list(spellings("A_B"))


def token(alphabet: str, n: int) -> str:
    """A fresh random body: each run's values are unique, so finding one anywhere is a leak."""
    return "".join(secrets.choice(alphabet) for _ in range(n))


ALNUM = string.ascii_letters + string.digits
UPPER = string.ascii_uppercase + string.digits
# Each shape (a well-known format) as (template, alphabet, length): a value is the template with
# a fresh random body, and the body is what must never be shown.
SHAPES = {
    "huggingface": ("hf_{}", ALNUM, 34),
    "github classic": ("ghp_{}", ALNUM, 36), "github oauth": ("gho_{}", ALNUM, 36),
    "github user": ("ghu_{}", ALNUM, 36), "github server": ("ghs_{}", ALNUM, 36),
    "github refresh": ("ghr_{}", ALNUM, 36), "github fine-grained": ("github_pat_{}", ALNUM + "_", 82),
    "gitlab": ("glpat-{}", ALNUM, 20),
    "aws": ("AKIA{}", UPPER, 16), "aws session": ("ASIA{}", UPPER, 16),
    "google": ("AIza{}", ALNUM, 35),
    "slack": ("xoxb-1234567890-{}", ALNUM, 24), "slack user": ("xoxp-{}", ALNUM, 40),
    "openai": ("sk-{}", ALNUM, 48), "openai project": ("sk-proj-{}", ALNUM, 60),
    "anthropic": ("sk-ant-api03-{}", ALNUM, 90),
    "stripe": ("sk_live_{}", ALNUM, 24), "npm": ("npm_{}", ALNUM, 36),
    "pypi": ("pypi-AgEIcHlwaS5vcmc{}", ALNUM, 60),
    "jwt": ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.{}", ALNUM, 43),
    "jwt payload": ("eyJhbGciOiJIUzI1NiJ9.eyJ{}.sig", ALNUM, 40),
    "pem": ("-----BEGIN OPENSSH PRIVATE KEY-----\n{}\n-----END OPENSSH PRIVATE KEY-----", ALNUM, 64),
    "pem rsa": ("-----BEGIN RSA PRIVATE KEY-----\nMIIE{}", ALNUM, 64),
    "url password": ("postgres://user:{}@db.example.org:5432/x", ALNUM, 12),
    "https password": ("https://oauth2:{}@gitlab.example.org/g/r.git", ALNUM, 20),
    "bearer": ("Bearer {}", ALNUM, 32),
    "header": ("Authorization: token {}", ALNUM, 24),
    "cookie header": ("Cookie: session={}", ALNUM, 24),
    "export": ("--export=ALL,AUTHORIZATION={}", ALNUM, 10),
    "query": ("https://acct.blob.core.windows.net/c/f?sv=2024&sig={}", ALNUM, 30),
    "assignment": ("DB_PASSWORD={}", ALNUM, 10),
    "quoted assignment": ('HF_TOKEN="{} x"', ALNUM, 10),
    "flag": ("--api-key {}", ALNUM, 16),
    "flag assignment": ("--password={}", ALNUM, 16),
}


def shaped(shape: str) -> tuple[str, str]:
    """(a value of `shape`, its secret body)."""
    template, alphabet, n = SHAPES[shape]
    body = token(alphabet, n)
    return template.format(body), body


ORDINARY_VALUES = [
    "/scratch/user/data", "./data", "${HOME}/.cache", "${SCRATCH:-/tmp}/x", "gpt2", "meta-llama/Llama-3.1-8B",
    "wikitext-103-v1", "Salesforce/wikitext", "1", "0.5", "true", "", "AWS Libfabric", "^LL128", "PHB",
    "--exclusive", "--mem=0", "--export=ALL", "--export=ALL,HF_TOKEN,WANDB_API_KEY", "user@example.org",
    "https://huggingface.co/datasets/x", "http://proxy.example.org:3128", "https://user@example.org/x",
    "ssh://git@github.com/o/r.git", "git@github.com:o/r.git", "0123456789abcdef0123456789abcdef01234567",
    "hf_transfer", "hf_home", "sk-learn", "token", "Bearer", "eyJ", "PASSWORD=", "PASSWORD=$DB_PASSWORD",
    "HF_TOKEN=${HF_TOKEN}", "KEY=...", "--token-file /run/secrets/hf", "MAX_TOKENS=4096", "AUTHOR=me",
    "nvcr.io/nvidia/pytorch:25.12-py3", "localhost/slipway:0123456789ab", "com.hooks.aws_ofi_nccl.enabled",
    "%j", "logs/%j.out", "-comp zstd -Xcompression-level 3 -b 1M", "cuda12", "python3 -m trainer",
]


# ------------------------------------------------------------------ names


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_a_secret_name_is_caught_in_every_spelling(name):
    missed = {how: spelled for how, spelled in spellings(name).items() if not secret_name(spelled)}
    assert not missed, (name, missed)


@pytest.mark.parametrize("name", ORDINARY_NAMES)
def test_an_ordinary_name_is_not_a_secret_s(name):
    # the shell's PWD is ordinary as a whole name only (MYSQL_PWD, com.example.pwd are passwords)
    hows = ("upper", "lower") if name in ("PWD", "OLDPWD") else [h for h in SPELLINGS if h != "digit"]
    passed = {how: spelled for how, spelled in spellings(name).items() if how in hows}
    caught = {how: (spelled, secret_name(spelled)) for how, spelled in passed.items() if secret_name(spelled)}
    assert not caught, (name, name_words(name), caught)


@pytest.mark.parametrize("name, words", [
    ("hfToken", ["HF", "TOKEN"]), ("APIKey", ["API", "KEY"]), ("OAuth2Token", ["O", "AUTH", "2", "TOKEN"]),
    ("com.example.api-key", ["COM", "EXAMPLE", "API", "KEY"]), ("S3_KEY", ["S", "3", "KEY"]),
])
def test_names_are_split_into_words(name, words):
    assert name_words(name) == words


def test_run_together_words_are_caught_and_english_ones_are_not():
    for name in ["pgpassword", "sshpass", "apikey", "hftoken", "accesstoken", "sshkey", "clientsecret", "phpsessid",
                 "mycookies", "oauthtoken", "authorization", "authorize_ssh_key"]:
        assert secret_name(name), name
    for name in ["keyboard", "monkey", "turkey", "compass", "bypass", "passes", "tokenizer", "tokens", "author",
                 "authority", "sigma", "pattern", "patch", "keystore_dir"]:
        assert not secret_name(name), name


# ------------------------------------------------------------------ values


@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_is_found_and_masked(shape):
    value, body = shaped(shape)
    assert find_secrets(value), (shape, value)
    masked = mask(value)
    assert "<hidden>" in masked and body not in masked, (shape, masked)


@pytest.mark.parametrize("value", ORDINARY_VALUES)
def test_an_ordinary_value_is_not_a_secret(value):
    assert secret_shape(value) is None and mask(value) == value, find_secrets(value)
    assert refusal(value) is None or "${HF_TOKEN}" in value  # a config value may not expand a secret


SEPARATORS = [" ", "\n", "\t", ",", ";", "'", '"', "(", "[", "{", "=", ":", "/", "|", "`"]


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(shape=st.sampled_from(sorted(SHAPES)), before=st.text(max_size=40), after=st.text(max_size=40),
       left=st.sampled_from(SEPARATORS), right=st.sampled_from(SEPARATORS))
def test_a_secret_inside_any_text_is_masked(shape, before, after, left, right):
    value, body = shaped(shape)
    text = f"{before}{left}{value}{right}{after}"
    assert body not in mask(text), (shape, text)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(text=st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_mask_never_fails_and_keeps_what_is_not_a_secret(text):
    masked = mask(text)
    if not find_secrets(text):
        assert masked == text
    assert mask(masked) == masked  # what it shows is already clean


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(SECRET_NAMES), how=st.sampled_from(SPELLINGS),
       value=st.text(alphabet=ALNUM + "+-_.~!#%^", min_size=1, max_size=30))
def test_a_secret_name_given_a_literal_value_is_refused(name, how, value):
    spelled = spellings(name)[how]
    assert refusal(value, name=spelled) is not None
    assert refusal(value, name=spelled, policy=REFERENCE) is not None
    # the pass-through forms: its own variable, a file's path, nothing
    assert refusal(f"${{{spelled}}}", name=spelled, policy=PASSTHROUGH) is None or how in ("kebab", "annotation")
    assert refusal("/run/secrets/" + value.replace("/", ""), name=spelled) is None
    assert refusal("", name=spelled) is None


def test_expansions_of_a_secret_variable():
    assert refusal("Bearer ${HF_TOKEN}").expansion
    assert refusal("${HF_TOKEN}", name="HF_TOKEN", policy=PASSTHROUGH) is None
    assert refusal("${OTHER}", name="HF_TOKEN", policy=PASSTHROUGH) is not None  # a secret's name takes its own only
    assert refusal("${HF_TOKEN}", name="X", policy=PASSTHROUGH).expansion  # pyxis would assign it on the srun line
    assert refusal("${HF_TOKEN}", name="com.example.hf_token", policy=REFERENCE) is None  # expanded by the CE
    # `$$` is a literal `$` in EDF text: `$${HF_TOKEN}` expands nothing there; in a shell value it does
    assert refusal("$${HF_TOKEN}", name="X", edf=True) is None
    assert refusal("$${HF_TOKEN}", name="X").expansion
    assert refusal("${SSH_AUTH_SOCK}:/agent") is None and refusal("${HOME}/x") is None


# ------------------------------------------------------------------ messages


def test_shown_and_every_error_mask_what_they_quote():
    value, body = shaped("huggingface")
    assert body not in shown(f"a {value} b")
    assert body not in shown(["x", {"k": value}])
    assert shown("x", "container.env.HF_TOKEN").startswith("<a value, hidden")
    # a message built without `shown` is masked as the error is made; so is its field
    exc = ConfigError(f"container.env.{value}", f"got {value!r} and --export=ALL,AUTHORIZATION=abc123")
    assert body not in str(exc) and "abc123" not in str(exc) and "AUTHORIZATION=<hidden>" in str(exc)
    # a cut never leaves a token's start too short to be recognised
    for pad in range(0, 90, 7):
        assert body[:6] not in bounded("x" * pad + " " + value), pad
    assert "export HF_TOKEN=..." in str(ConfigError("f", "`export HF_TOKEN=...` first"))  # a placeholder stays


def test_the_lock_record_of_a_command_is_masked(tmp_path):
    from jobs.runs import lock

    value, body = shaped("github classic")
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)  # a launch that leaves no run directory leaves no lock file
    with lock.hold(run_dir, f"slipway local cfg 'launch.command=[x, --token, {value}]' --password hunter2"):
        text = lock.lock_path(run_dir).read_text()
        assert body not in text and "hunter2" not in text and "--password <hidden>" in json.loads(text)["command"]
    # a record an older version wrote unmasked is masked where it is shown
    lock.lock_path(run_dir).write_text(json.dumps({"pid": 1, "host": "h", "command": f"x {value}"}))
    assert body not in lock.describe(json.loads(lock.lock_path(run_dir).read_text()))
