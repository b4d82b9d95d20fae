"""Regenerate the builtin corpus and tokenizer: `.venv/bin/python tests/make_assets.py [OUT]`.

The corpus is real English prose written by people: the docstrings of the
Python standard library and the Python language reference topics that ship
with CPython (`pydoc_data.topics`), plus the Zen of Python (`this`). All of it
is under the PSF License Version 2 (see README.md here). Nothing is fetched:
the text comes from the interpreter that runs this script, so the output is
byte-identical when run again with the same CPython version (the one used is
recorded in README.md) and the same `tokenizers` version.

Outputs, in OUT (default: trainer/assets/, where the product reads them):
- corpus.jsonl.gz: one JSON object per document, {"text": ..., "source": ...};
  documents are shuffled with a fixed seed so a held-out tail is a fair sample.
- tokenizer.json: byte-level BPE with `VOCAB_SIZE` entries, trained on the
  corpus, whose only special token is `<|endoftext|>` (the document separator).
- LICENSE-Python.txt: CPython's LICENSE, which the PSF License asks to retain.
"""

from __future__ import annotations

import ast
import codecs
import gzip
import io
import json
import random
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
SEED = 1234
ASSETS = Path(__file__).resolve().parents[1] / "trainer" / "assets"
# Trivial or machine-generated docstrings (codecs tables), tests and vendored code.
SKIP_PARTS = {"site-packages", "test", "tests", "encodings", "pydoc_data", "_bundled", "__phello__"}
MIN_DOC_CHARS = 200


def module_document(path: Path, name: str) -> str | None:
    """A module's docstrings, in source order, each under the name it documents."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    parts: list[str] = []
    module_doc = ast.get_docstring(tree)
    if module_doc:
        parts.append(f"Module {name}\n\n{module_doc}")

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    kind = "class" if isinstance(child, ast.ClassDef) else "def"
                    parts.append(f"{kind} {name}.{qualname}\n\n{doc}")
                visit(child, f"{qualname}.")

    visit(tree, "")
    text = "\n\n".join(parts)
    return text if len(text) >= MIN_DOC_CHARS else None


def collect_documents() -> list[dict[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if SKIP_PARTS & set(rel.parts):
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        text = module_document(path, name)
        if text:
            docs.append({"text": text, "source": f"cpython-{sys.version.split()[0]}/Lib/{rel.as_posix()}"})
    from pydoc_data.topics import topics

    for key in sorted(topics):
        docs.append({"text": topics[key].strip(), "source": f"pydoc_data.topics[{key!r}]"})
    import this  # noqa: F401  (prints the Zen once; its text is this.s, rot13)

    docs.append({"text": codecs.decode(this.s, "rot13"), "source": "this (PEP 20, The Zen of Python)"})
    random.Random(SEED).shuffle(docs)
    return docs


def write_corpus(docs: list[dict[str, str]], path: Path) -> None:
    raw = io.BytesIO()
    # mtime=0 and no file name: the same documents give the same bytes.
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        for doc in docs:
            gz.write((json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8"))
    path.write_bytes(raw.getvalue())


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main(out: Path = ASSETS) -> None:
    import contextlib

    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints
        docs = collect_documents()
    write_corpus(docs, out / "corpus.jsonl.gz")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    license_file = next(p for p in (stdlib / "LICENSE.txt", stdlib.parent / "LICENSE.txt") if p.exists())
    (out / "LICENSE-Python.txt").write_bytes(license_file.read_bytes())
    tok = train_tokenizer([d["text"] for d in docs])
    tok.save(str(out / "tokenizer.json"), pretty=False)
    n_chars = sum(len(d["text"]) for d in docs)
    n_bytes = sum(len(d["text"].encode("utf-8")) for d in docs)
    n_tokens = sum(len(e.ids) for e in tok.encode_batch([d["text"] for d in docs], add_special_tokens=False))
    print(f"python {sys.version.split()[0]}: {len(docs)} documents, {n_chars:,} characters, "
          f"{n_bytes:,} bytes of UTF-8, {n_tokens:,} tokens (vocab {tok.get_vocab_size()}, "
          f"{EOS} = {tok.token_to_id(EOS)}); corpus.jsonl.gz {(out / 'corpus.jsonl.gz').stat().st_size:,} bytes, "
          f"tokenizer.json {(out / 'tokenizer.json').stat().st_size:,} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS)
