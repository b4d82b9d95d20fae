"""Tokenization throughput of `slipway prepare` (`trainer.prepare.prepare`), side by side.

Input: the builtin corpus written `--copies` times into one JSON Lines file
(default 4: 10.2 MB of text). Two tokenizers: the builtin one (byte-level
BPE, vocabulary 4096) and a gpt2-sized byte-level BPE (vocabulary 50257,
gpt2's pre-tokenizer and `<|endoftext|>`), trained here with the tokenizers
library on the corpus and this interpreter's standard library sources
(nothing is downloaded; cached in `.cache/bench-data/`). For each, at 1 and
`--procs` (default 2) workers:

- ceiling: the tokenizers library's own `encode_batch_fast` over every
  document already in memory, on its Rayon pool of N threads; no reading,
  no flattening, no writing.
- prepare: ours, end to end into an empty cache: read, tokenize on N
  threads, write the flat file and its index, fsync.
- rayon / processes: the two designs `prepare` did not take, on the same
  reader and writer: one `encode_batch_fast` per batch on Rayon's pool of N
  threads, or a pool of N spawned processes each encoding whole batches.

Every case runs in a fresh process (Rayon's pool is sized once per process),
and the cases are interleaved `--repeat` times so that load from other work
falls on all of them alike; the table gives the median and best of each, the
CPU time per token (robust to that load: what each design costs, whatever
cores it got) and the cores each got. How busy the machine was is measured
before and after: how many cores a busy loop in `--procs` processes got.
Also: opening a prepared cache (`build_data` on a hit) and `next_batch()` of
64 x 512. Run: `.venv/bin/python bench/data.py [--repeat 3] [--copies 4]`.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GPT2_VOCAB = 50257


def corpus_docs() -> list[str]:
    from trainer.data_sources import BUILTIN_CORPUS

    with gzip.open(BUILTIN_CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def gpt2_sized_tokenizer(cache: Path) -> Path:
    """A byte-level BPE with gpt2's vocabulary size, trained once and cached."""
    import tokenizers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = cache / f"bpe{GPT2_VOCAB}-py{sys.version.split()[0]}-tokenizers{tokenizers.__version__}.json"
    if path.exists():
        return path
    # The corpus alone has too few distinct words for 50257 merges; the
    # standard library's sources (the corpus's own origin) add enough.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = corpus_docs() + [p.read_text(encoding="utf-8", errors="replace")
                             for p in sorted(stdlib.rglob("*.py")) if "site-packages" not in p.parts]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # gpt2's regex and byte mapping
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=GPT2_VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != GPT2_VOCAB:
        raise SystemExit(f"the trained BPE has {tok.get_vocab_size()} tokens, not {GPT2_VOCAB}")
    cache.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


# --------------------------------------------------------------------------
# One case, in its own process
# --------------------------------------------------------------------------


@contextlib.contextmanager
def timed(result: dict):
    """Wall time and CPU time (this process's threads and its reaped children) into `result`."""
    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    wall, used = time.perf_counter(), cpu()
    yield
    result["seconds"], result["cpu_s"] = time.perf_counter() - wall, cpu() - used


def case_ceiling(data: Path, tokenizer: str, n: int) -> dict:
    from tokenizers import Tokenizer

    with open(data, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    tok = Tokenizer.from_file(tokenizer)
    result: dict = {}
    with timed(result):
        result["tokens"] = sum(len(e.ids) for e in tok.encode_batch_fast(docs, add_special_tokens=False)) + len(docs)
    return result


def case_prepare(data: Path, tokenizer: str, n: int, work: Path) -> dict:
    from trainer.config import DataSection
    from trainer.prepare import prepare

    result: dict = {}
    with timed(result):
        prepared = prepare(DataSection(dataset=str(data), tokenizer=tokenizer), work, num_proc=n,
                           progress=lambda p: None)
    return {**result, "tokens": sum(e.index["n_tokens"] for e in prepared.entries)}


_worker: dict = {}


def _init_worker(tokenizer: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    import trainer.data_tokenize as t

    tok = Tokenizer.from_file(tokenizer)
    _worker["encode"] = t._encoder(tok, tok.token_to_id("<|endoftext|>"), __import__("numpy").dtype("uint16"))


def _encode_in_worker(texts: list[str]) -> bytes:
    return _worker["encode"](texts).tobytes()


def case_alternative(data: Path, tokenizer: str, n: int, work: Path, how: str) -> dict:
    """Our reader and writer around the parallelism `prepare` did not pick."""
    import multiprocessing
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    import numpy as np
    from tokenizers import Tokenizer

    import trainer.data_tokenize as t
    from trainer.data_sources import resolve_source

    result: dict = {}
    source = resolve_source(str(data), None, "train", "text")
    written = 0
    with timed(result), open(work / "tokens.bin", "wb") as f:
        if how == "rayon":
            tok = Tokenizer.from_file(tokenizer)
            encode = t._encoder(tok, tok.token_to_id("<|endoftext|>"), np.dtype("uint16"))
            for batch in source.open().batches:
                ids = encode(batch.texts)
                f.write(ids.tobytes())
                written += len(ids)
        else:
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(n, mp_context=ctx, initializer=_init_worker, initargs=(tokenizer,)) as pool:
                pending: deque = deque()
                for batch in source.open().batches:
                    pending.append(pool.submit(_encode_in_worker, batch.texts))
                    while len(pending) >= 2 * n or (pending and pending[0].done()):
                        data_bytes = pending.popleft().result()
                        f.write(data_bytes)
                        written += len(data_bytes) // 2
                while pending:
                    data_bytes = pending.popleft().result()
                    f.write(data_bytes)
                    written += len(data_bytes) // 2
        f.flush()
        os.fsync(f.fileno())
    return {**result, "tokens": written}


def case_open(tokenizer: str) -> dict:
    """A prepared cache hit: `build_data` (what the job does before step 1) and a 64 x 512 batch."""
    from trainer.config import DataSection, ModelSection, TrainSection, TrainerConfig
    from trainer.data import build_data
    from trainer.prepare import prepare

    work = Path(tempfile.mkdtemp(prefix="slipway-bench-open-"))
    try:
        cfg = TrainerConfig(data=DataSection(tokenizer=tokenizer, seq_len=512, cache_dir=str(work)),
                            train=TrainSection(micro_batch_size=64), model=ModelSection(size="tiny"))
        prepare(cfg.data, work, progress=lambda p: None)
        opens = []
        for _ in range(5):
            start = time.perf_counter()
            train, _, _ = build_data(cfg, work, 0, 1)
            opens.append(time.perf_counter() - start)
        start, batches = time.perf_counter(), 0
        while time.perf_counter() - start < 1.0:
            train.next_batch()
            batches += 1
        return {"open_ms": statistics.median(opens) * 1e3,
                "batch_ms": (time.perf_counter() - start) / batches * 1e3}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def cores_free(n: int) -> float:
    """How many of `n` cores a CPU-bound process gets now: `n` copies of a
    busy loop against one alone (2.0 on an idle 2-core machine)."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(n) as pool:
        start = time.perf_counter()
        pool.map(_spin, [3_000_000])
        alone = time.perf_counter() - start
        start = time.perf_counter()
        pool.map(_spin, [3_000_000] * n, chunksize=1)
        together = time.perf_counter() - start
    return n * alone / together


def run_case(spec: dict) -> dict:
    work = Path(tempfile.mkdtemp(prefix="slipway-bench-data-"))
    try:
        data, tokenizer, n, how = Path(spec["data"]), spec["tokenizer"], spec["n"], spec["how"]
        if how == "ceiling":
            return case_ceiling(data, tokenizer, n)
        if how == "prepare":
            return case_prepare(data, tokenizer, n, work)
        if how == "open":
            return case_open(tokenizer)
        return case_alternative(data, tokenizer, n, work, how)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def in_fresh_process(spec: dict) -> dict:
    env = {**os.environ, "RAYON_NUM_THREADS": str(spec["n"]), "HF_HUB_OFFLINE": "1", "RANK": "0",
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "--case", json.dumps(spec)], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------
# All cases, interleaved
# --------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="rounds over all cases (median and best reported)")
    parser.add_argument("--copies", type=int, default=4, help="copies of the builtin corpus in the input")
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 1, help="the larger worker count")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    from trainer.data_sources import BUILTIN_TOKENIZER

    tokenizers = {"builtin (4096)": str(BUILTIN_TOKENIZER),
                  f"gpt2-sized BPE ({GPT2_VOCAB})": str(gpt2_sized_tokenizer(ROOT / ".cache" / "bench-data"))}
    work = Path(tempfile.mkdtemp(prefix="slipway-bench-input-"))
    try:
        data = work / "corpus.jsonl"
        docs = corpus_docs()
        with open(data, "w", encoding="utf-8") as f:
            for _ in range(args.copies):
                f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        chars = sum(map(len, docs)) * args.copies
        counts = sorted({1, args.procs})
        cases = [(name, how, n) for name in tokenizers for how in ("ceiling", "prepare", "rayon", "processes")
                 for n in counts]
        load_before, free_before = os.getloadavg(), cores_free(args.procs)
        results: dict[tuple, list[dict]] = {c: [] for c in cases}
        for _ in range(args.repeat):
            for name, how, n in cases:
                spec = {"data": str(data), "tokenizer": tokenizers[name], "n": n, "how": how}
                results[(name, how, n)].append(in_fresh_process(spec))
        load_after, free_after = os.getloadavg(), cores_free(args.procs)
        opened = {name: in_fresh_process({"data": "", "tokenizer": path, "n": 1, "how": "open"})
                  for name, path in tokenizers.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"input: the builtin corpus x {args.copies} = {chars / 1e6:.1f} M characters of JSON Lines; "
          f"{args.repeat} rounds; {os.cpu_count()} cores; load average {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after; cores a busy process got: {free_before:.2f} before, {free_after:.2f} after")
    print("| tokenizer | method | workers | tokens | M tokens/s (median) | M tokens/s (best) | best / best ceiling "
          "| CPU s per M tokens (median) | cores used (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, how, n in cases:
        runs = results[(name, how, n)]
        best_ceiling = max(r["tokens"] / r["seconds"] for r in results[(name, "ceiling", n)])
        rates = [r["tokens"] / r["seconds"] for r in runs]
        cpu_per_m = statistics.median(r["cpu_s"] / r["tokens"] * 1e6 for r in runs)
        used = statistics.median(r["cpu_s"] / r["seconds"] for r in runs)
        print(f"| {name} | {how} | {n} | {runs[0]['tokens']:,} | {statistics.median(rates) / 1e6:.2f} "
              f"| {max(rates) / 1e6:.2f} | {max(rates) / best_ceiling:.0%} | {cpu_per_m:.2f} | {used:.2f} |")
    for name, r in opened.items():
        print(f"{name}: open a prepared cache (build_data on a hit) {r['open_ms']:.1f} ms, "
              f"next_batch 64 x 512 {r['batch_ms']:.2f} ms")
    print("ceiling: encode_batch_fast on documents in memory (no read, no write); prepare: ours, read + tokenize "
          "+ write + fsync; rayon / processes: the alternatives on our reader and writer")


if __name__ == "__main__":
    main()
