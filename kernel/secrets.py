"""The secret policy: which names and values must never reach a file, a command line or a terminal."""

from __future__ import annotations

import re
from typing import Optional


# A variable name that looks like it holds a secret, matched case-insensitively anywhere in the
# name (HF_TOKEN, wandb_key, my_api_key, AWS_SECRET_ACCESS_KEY, DB_PASSWD, GIT_CREDENTIALS, OAUTH_X),
# except TOKENIZ... (TOKENIZERS_PARALLELISM) and AUTHOR..., which name no secret.
SECRET_WORD = re.compile(r"TOKEN(?!IZ)|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH(?!OR)|PRIVATE", re.IGNORECASE)
# NAME=value inside a value the user gave (an sbatch option `--export=ALL,HF_TOKEN=x`).
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=([^,\s'\"]*)")


def secret_word(name: str) -> Optional[str]:
    """The part of `name` that makes it look like a secret's name (upper case), or None."""
    m = SECRET_WORD.search(name) if isinstance(name, str) else None
    return m.group(0).upper() if m else None

