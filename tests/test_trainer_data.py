"""The trainer's data pipeline: the token cache, its file barrier, local formats, sampling and sharding."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.data_cache as data_cache
from common.errors import ConfigError
from trainer.config import DataSection, ModelSection, RunSection, TrainSection, TrainerConfig
from trainer.data import Sampler, build_data
from trainer.data_cache import resolve_cache_dir
from trainer.prepare import check_tokens
from trainer.data_sources import BUILTIN_TOKENIZER, resolve_source
from trainer.data_tokenize import load_tokenizer, resolve_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TOK = load_tokenizer(resolve_tokenizer("builtin"))
EOS = TOK.token_to_id("<|endoftext|>")
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return a new list containing all items from the iterable in ascending order.",
    "Errors should never pass silently. Unless explicitly silenced.",
    "A context manager that changes the current working directory and restores it on exit.",
    "In the face of ambiguity, refuse the temptation to guess.",
] * 40


def expected_stream(docs: list[str]) -> np.ndarray:
    return np.array([t for d in docs for t in TOK.encode(d, add_special_tokens=False).ids + [EOS]])


def config(tmp: Path, **data) -> TrainerConfig:
    data.setdefault("cache_dir", str(tmp / "cache dir 'q' $(x)"))
    data.setdefault("seq_len", 16)
    data.setdefault("validation_fraction", 0.0)
    data.setdefault("tokenize_in_job", True)  # the in-job path; tests/test_prepare*.py cover prepared caches
    return TrainerConfig(run=RunSection(seed=7), data=DataSection(**data), train=TrainSection(micro_batch_size=4),
                         model=ModelSection(size="custom", hidden_size=64, intermediate_size=128, num_layers=2,
                                            num_heads=4, num_kv_heads=4, vocab_size=4096,
                                            max_position_embeddings=512))


def write_jsonl(path: Path, docs: list[str], **extra) -> Path:
    path.write_text("".join(json.dumps({"text": d, **extra}) + "\n" for d in docs))
    return path


def cache_files(cfg: TrainerConfig) -> list[Path]:
    return sorted(Path(cfg.data.cache_dir).iterdir())


def all_tokens(sampler: Sampler) -> np.ndarray:
    return np.asarray(sampler.tokens)


# --------------------------------------------------------------------------
# The cache: built once, keyed on the inputs, written atomically
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_builtin_corpus_built_once_then_reused(tmp_path, monkeypatch):
    calls = []
    real = data_cache.write_tokens
    monkeypatch.setattr(data_cache, "write_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = config(tmp_path, dataset="builtin", tokenizer="builtin", seq_len=128, validation_fraction=0.01)
    train, val, vocab = build_data(cfg, tmp_path / "runs" / "r", 0, 1)
    assert vocab == 4096 and len(calls) == 1
    (bin_file,) = [p for p in cache_files(cfg) if p.suffix == ".bin"]
    mtime = bin_file.stat().st_mtime_ns
    index = json.loads(bin_file.with_suffix(".json").read_text())
    assert index["dtype"] == "uint16" and index["vocab_size"] == 4096 and index["n_documents"] > 500
    assert 1_000_000 > bin_file.stat().st_size / 2 == index["n_tokens"] > 500_000

    cfg.data.seq_len = 64  # windows are cut at read time: same cache
    train2, _, _ = build_data(cfg, tmp_path / "runs" / "r", 0, 1)
    assert len(calls) == 1 and bin_file.stat().st_mtime_ns == mtime
    assert [p.suffix for p in cache_files(cfg)] == [".bin", ".json"]  # no lock, tmp or error left
    inputs_BT, targets_BT = train.next_batch()
    assert inputs_BT.shape == targets_BT.shape == (4, 128) and inputs_BT.dtype == torch.long
    assert torch.equal(inputs_BT[:, 1:], targets_BT[:, :-1])
    assert int(inputs_BT.max()) < vocab and val is not None and val.n_windows > 10


@pytest.mark.slow
def test_make_assets_regenerates_the_shipped_assets_byte_for_byte(tmp_path):
    """tests/make_assets.py, under the CPython and tokenizers versions trainer/assets/README.md
    names, makes exactly the files the product ships."""
    import tokenizers

    assets = Path(__file__).resolve().parents[1] / "trainer" / "assets"
    versions = f"CPython {sys.version.split()[0]} and tokenizers {'.'.join(tokenizers.__version__.split('.')[:2])}"
    if versions not in (assets / "README.md").read_text():
        pytest.skip(f"the assets were made under other versions than {versions}")
    subprocess.run([sys.executable, Path(__file__).with_name("make_assets.py"), tmp_path], check=True,
                   capture_output=True)
    for name in ("corpus.jsonl.gz", "tokenizer.json", "LICENSE-Python.txt"):
        assert (tmp_path / name).read_bytes() == (assets / name).read_bytes(), name


def test_default_cache_dir_is_beside_runs(tmp_path):
    assert resolve_cache_dir(DataSection(), tmp_path / "runs" / "exp1") == tmp_path.resolve() / ".cache" / "tokens"
    cfg = config(tmp_path, dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)))
    cfg.data.cache_dir = None
    build_data(cfg, tmp_path / "runs" / "exp1", 0, 1)
    assert any((tmp_path / ".cache" / "tokens").glob("d.jsonl-*.json"))


def test_cache_key_follows_the_file(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    cfg = config(tmp_path, dataset=str(data))
    first = all_tokens(build_data(cfg, tmp_path / "runs" / "r", 0, 1)[0]).copy()
    write_jsonl(data, DOCS[:150])
    second = all_tokens(build_data(cfg, tmp_path / "runs" / "r", 0, 1)[0])
    assert len(second) < len(first)
    assert len([p for p in cache_files(cfg) if p.suffix == ".json"]) == 2


def test_interrupted_writer_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    source = resolve_source(str(write_jsonl(tmp_path / "d.jsonl", DOCS)), None, "train", "text")
    real_open = type(source).open

    def broken_open(self, *args, **kwargs):
        reader = real_open(self, *args, **kwargs)
        first = next(reader.batches)

        def batches():
            yield first
            raise KeyboardInterrupt

        reader.batches = batches()
        return reader

    monkeypatch.setattr(type(source), "open", broken_open)
    with pytest.raises(KeyboardInterrupt):
        data_cache.ensure_tokens(source, resolve_tokenizer("builtin"), tmp_path / "c", rank=0)
    # no index, no .bin, no lock: only the partial file a rerun continues
    paths = data_cache.cache_paths(source, resolve_tokenizer("builtin"), tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir()] == [paths.partial.name]
    monkeypatch.undo()
    found = data_cache.ensure_tokens(source, resolve_tokenizer("builtin"), tmp_path / "c", rank=0)
    np.testing.assert_array_equal(found.tokens, expected_stream(DOCS))
    assert sorted(p.suffix for p in (tmp_path / "c").iterdir()) == [".bin", ".json"]


def test_killed_writer_leaves_no_index_and_is_taken_over(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    script = f"""
        import sys, time
        from pathlib import Path
        import trainer.data_sources as s, trainer.data_cache as c, trainer.data_tokenize as t
        real_open = s.TextSource.open
        def slow_open(self, *args, **kwargs):
            reader = real_open(self, *args, **kwargs)
            def slow(batches):
                for b in batches:
                    yield b
                    Path({str(tmp_path / 'started')!r}).touch()
                    time.sleep(60)
            reader.batches = slow(reader.batches)
            return reader
        s.TextSource.open = slow_open
        s.BATCH_CHARS = 500
        c.ensure_tokens(s.resolve_source({str(data)!r}, None, "train", "text"), t.resolve_tokenizer("builtin"),
                        Path({str(tmp_path / 'c')!r}), rank=0)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=_env())
    _wait_for(tmp_path / "started", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert not [n for n in names if n.endswith((".json", ".bin"))]
    assert [n for n in names if n.endswith(".lock")] and [n for n in names if n.endswith(".bin.partial")]
    # the dead writer's pid is gone on this host: rank 0 takes the lock over at once, never waiting for
    # the lock to go stale (no resume record yet: it writes its partial file again from the start)
    with never_waiting():
        train, _, _ = build_data(config(tmp_path, dataset=str(data), cache_dir=str(tmp_path / "c")), tmp_path, 0, 1)
    np.testing.assert_array_equal(all_tokens(train), expected_stream(DOCS))
    assert sorted(p.suffix for p in (tmp_path / "c").iterdir()) == [".bin", ".json"]


# --------------------------------------------------------------------------
# The file barrier: many ranks, one writer
# --------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        assert proc.poll() is None, "the writer exited early"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


BARRIER_SCRIPT = """
import hashlib, os, sys, time
from pathlib import Path
import trainer.data_cache as c, trainer.data_sources as s, trainer.data_tokenize as t
real = c.write_tokens
def marked(*args, **kwargs):
    Path(sys.argv[2], f"wrote-{os.getpid()}").touch()
    time.sleep(1.5)  # keep the others waiting on the barrier
    return real(*args, **kwargs)
c.write_tokens = marked
found = c.ensure_tokens(s.resolve_source(sys.argv[1], None, "train", "text"), t.resolve_tokenizer("builtin"),
                        Path(sys.argv[2], "cache"), timeout_s=60)
print(hashlib.sha256(found.tokens.tobytes()).hexdigest(), found.index["n_tokens"])
"""


@pytest.mark.slow
def test_file_barrier_one_writer_all_ranks_same_data(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    out = tmp_path / "out dir"
    out.mkdir()
    # two launches share the cache: ranks 0-2 of one, rank 0 of another; all start at once
    ranks = ["1", "2", "0", "0"]
    procs = [subprocess.Popen([sys.executable, "-c", BARRIER_SCRIPT, str(data), str(out)], cwd=ROOT,
                              env=_env(RANK=r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in ranks]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert len(list(out.glob("wrote-*"))) == 1
    lines = {stdout.strip() for stdout, _ in results}
    assert len(lines) == 1
    digest = hashlib.sha256(expected_stream(DOCS).astype(np.uint16).tobytes()).hexdigest()
    assert lines.pop().split()[0] == digest


@contextlib.contextmanager
def never_waiting():
    """The token cache's wait for another writer (its one poll, trainer/data_cache.py) made an
    error: what a test holds instead of a bound on the time it took."""
    def waited(seconds: float) -> None:
        raise AssertionError(f"waited {seconds} s for another writer instead of taking its lock over")

    real, data_cache.time.sleep = data_cache.time.sleep, waited
    try:
        yield
    finally:
        data_cache.time.sleep = real


def _source_and_tok(tmp_path: Path):
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    return resolve_source(str(data), None, "train", "text"), resolve_tokenizer("builtin")


def test_rank0_takes_over_a_lock_whose_pid_died(tmp_path):
    source, tok = _source_and_tok(tmp_path)
    paths = data_cache.cache_paths(source, tok, tmp_path / "c")
    paths.dir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    paths.lock.write_text(json.dumps({"pid": dead.pid, "host": data_cache._host(), "token": "x"}))
    with never_waiting():
        found = data_cache.ensure_tokens(source, tok, paths.dir, rank=0, stale_s=600, timeout_s=600)
    assert found.index["n_documents"] == len(DOCS)
    assert not paths.lock.exists()


@pytest.mark.parametrize("pid", ["4242", None, -1, 0, 10**30, True, [1]])
def test_a_lock_whose_pid_names_no_process_is_judged_by_its_heartbeat(tmp_path, pid):
    """Damaged, or a tool's that wrote another shape: neither a crash nor `os.kill(-1, 0)` (every
    process) decides; a fresh lock is alive, its writer named as written, a silent one stale."""
    lock = tmp_path / "x.lock"
    lock.write_text(json.dumps({"pid": pid, "host": data_cache._host(), "token": "x"}))
    watch = data_cache.LockWatch(lock, stale_s=0.2)
    assert watch.state() == "alive" and data_cache._live_writer(lock) == f"pid {pid} on {data_cache._host().split('/')[0]}"
    time.sleep(0.3)
    assert watch.state() == "stale"


def test_rank0_takes_over_a_lock_without_heartbeat_from_another_host(tmp_path):
    source, tok = _source_and_tok(tmp_path)
    paths = data_cache.cache_paths(source, tok, tmp_path / "c")
    paths.dir.mkdir()
    paths.lock.write_text(json.dumps({"pid": 1, "host": "elsewhere/pid:[1]", "token": "x"}))
    found = data_cache.ensure_tokens(source, tok, paths.dir, rank=0, stale_s=1.0, timeout_s=30)
    assert found.index["n_tokens"] == len(expected_stream(DOCS))


def test_waiter_names_the_lock_when_the_writer_is_gone(tmp_path):
    source, tok = _source_and_tok(tmp_path)
    paths = data_cache.cache_paths(source, tok, tmp_path / "c")
    with pytest.raises(data_cache.DataCacheError, match="no process holds its lock .*rank 0 never started"):
        data_cache.ensure_tokens(source, tok, paths.dir, rank=1, timeout_s=0.5)
    paths.lock.write_text(json.dumps({"pid": 4242, "host": "node7/pid:[1]", "token": "x"}))
    with pytest.raises(data_cache.DataCacheError) as err:
        data_cache.ensure_tokens(source, tok, paths.dir, rank=1, stale_s=0.3, timeout_s=0.6)
    assert f"delete {paths.lock} and rerun" in str(err.value) and "pid 4242 on node7" in str(err.value)


def test_waiters_get_the_writers_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-1")
    data = write_jsonl(tmp_path / "d.jsonl", DOCS, title="t")
    source = resolve_source(str(data), None, "train", "txt")
    tok = resolve_tokenizer("builtin")
    with pytest.raises(ConfigError, match="column 'txt'"):
        data_cache.ensure_tokens(source, tok, tmp_path / "c", rank=0)
    with pytest.raises(ConfigError, match=r"^data.text_column: column 'txt' not in .* \(columns: text, title\)$"):
        data_cache.ensure_tokens(source, tok, tmp_path / "c", rank=1, timeout_s=5)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-2")  # a later launch ignores the old error
    with pytest.raises(data_cache.DataCacheError, match="waited"):
        data_cache.ensure_tokens(source, tok, tmp_path / "c", rank=1, timeout_s=0.3)


# --------------------------------------------------------------------------
# Local formats and tokenizers
# --------------------------------------------------------------------------


def _write_format(tmp_path: Path, fmt: str) -> str:
    half = len(DOCS) // 2
    if fmt == "txt file":
        (tmp_path / "a.txt").write_text("\n\n".join(DOCS) + "\n")
        return str(tmp_path / "a.txt")
    if fmt == "txt glob":
        (tmp_path / "a.txt").write_text("\n\n\n".join(DOCS[:half]))
        (tmp_path / "b.txt").write_text("\n".join(DOCS[half:]).replace(".\n", ".\n\n"))
        return str(tmp_path / "*.txt")
    if fmt == "jsonl dir":
        (tmp_path / "d").mkdir()
        write_jsonl(tmp_path / "d" / "0.jsonl", DOCS[:half], title="x")
        write_jsonl(tmp_path / "d" / "1.jsonl", DOCS[half:], title="y")
        return str(tmp_path / "d")
    if fmt == "jsonl.gz":
        with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS)
        return str(tmp_path / "d.jsonl.gz")
    if fmt == "json array":
        (tmp_path / "d.json").write_text(json.dumps([{"text": d, "n": i} for i, d in enumerate(DOCS)]))
        return str(tmp_path / "d.json")
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), tmp_path / "d.parquet",
                       row_group_size=37)
        return str(tmp_path / "d.parquet")
    if fmt == "save_to_disk":
        import datasets

        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
        return str(tmp_path / "saved")
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["txt file", "txt glob", "jsonl dir", "jsonl.gz", "json array", "parquet",
                                 "save_to_disk"])
def test_local_formats(tmp_path, fmt):
    spec = _write_format(tmp_path, fmt)
    train, val, vocab = build_data(config(tmp_path, dataset=spec), tmp_path / "runs" / "r", 0, 1)
    np.testing.assert_array_equal(all_tokens(train), expected_stream(DOCS))
    assert val is None and vocab == 4096


def test_saved_dataset_dict_splits_and_validation_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS}),
                               "validation": datasets.Dataset.from_dict({"text": DOCS[:20]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    cfg = config(tmp_path, dataset=str(tmp_path / "dd"), validation_split="validation")
    train, val, _ = build_data(cfg, tmp_path, 0, 1)
    np.testing.assert_array_equal(all_tokens(train), expected_stream(DOCS))
    np.testing.assert_array_equal(all_tokens(val), expected_stream(DOCS[:20]))
    cfg.data.split = "test"
    with pytest.raises(ConfigError, match=r"^data.split: split 'test' not in .*\(splits: train, validation\)$"):
        build_data(cfg, tmp_path, 0, 1)


def test_local_validation_files(tmp_path):
    cfg = config(tmp_path, dataset=str(write_jsonl(tmp_path / "train.jsonl", DOCS)),
                 validation_split=str(write_jsonl(tmp_path / "val.jsonl", DOCS[:30])))
    _, val, _ = build_data(cfg, tmp_path, 0, 1)
    np.testing.assert_array_equal(all_tokens(val), expected_stream(DOCS[:30]))


@pytest.mark.parametrize("where", ["file", "dir"])
def test_local_tokenizer_by_file_or_directory(tmp_path, where):
    shutil.copy(BUILTIN_TOKENIZER, tmp_path / "tokenizer.json")
    spec = str(tmp_path / "tokenizer.json") if where == "file" else str(tmp_path)
    data = str(write_jsonl(tmp_path / "d.jsonl", DOCS))
    train, _, vocab = build_data(config(tmp_path, dataset=data, tokenizer=spec), tmp_path, 0, 1)
    assert vocab == 4096
    np.testing.assert_array_equal(all_tokens(train), expected_stream(DOCS))


def _gpt2_files(where: Path) -> Path:
    """The builtin tokenizer as GPT-2 ships its own: vocab.json + merges.txt, no tokenizer.json."""
    model = json.loads(BUILTIN_TOKENIZER.read_text())["model"]
    where.mkdir()
    (where / "vocab.json").write_text(json.dumps(model["vocab"]))
    (where / "merges.txt").write_text("#version: 0.2\n" + "".join(
        (m if isinstance(m, str) else " ".join(m)) + "\n" for m in model["merges"]))
    (where / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    return where


def test_directory_without_tokenizer_json_is_converted_by_transformers(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    spec = str(_gpt2_files(tmp_path / "gpt2"))
    data = str(write_jsonl(tmp_path / "d.jsonl", DOCS))
    train, _, vocab = build_data(config(tmp_path, dataset=data, tokenizer=spec), tmp_path, 0, 1)
    assert vocab == 4096
    np.testing.assert_array_equal(all_tokens(train), expected_stream(DOCS))  # the builtin's very tokens

    (tmp_path / "gpt2" / "merges.txt").write_text("not a merges file\n\x00")
    with pytest.raises(ConfigError, match=r"^data.tokenizer: could not load tokenizer '.*gpt2': "):
        load_tokenizer(resolve_tokenizer(spec))
    monkeypatch.setitem(sys.modules, "transformers", None)  # the login node's install has none
    with pytest.raises(ConfigError, match=r"has no tokenizer.json and transformers is not installed to convert it; "
                                          r"save it as tokenizer.json"):
        load_tokenizer(resolve_tokenizer(spec))


def test_local_data_never_touches_the_network(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    shutil.copy(BUILTIN_TOKENIZER, tmp_path / "tokenizer.json")
    spec = _write_format(tmp_path, "save_to_disk")
    build_data(config(tmp_path, dataset=spec, tokenizer=str(tmp_path / "tokenizer.json")), tmp_path, 0, 1)


# --------------------------------------------------------------------------
# Sampling: windows, epochs, resume, dp sharding, validation
# --------------------------------------------------------------------------


def test_windows_are_seq_len_plus_one_with_stride_seq_len_and_epochs_are_permutations():
    tokens = np.arange(10 * 8 + 1)  # exactly 10 windows of 8 + 1
    s = Sampler(tokens, seq_len=8, batch_size=3, seed=5)
    assert s.n_windows == 10
    seen = []
    for _ in range(10):  # 30 samples = 3 epochs
        x, y = s.next_batch()
        assert torch.equal(y, x + 1) and torch.all(x[:, 0] % 8 == 0)
        seen += (x[:, 0] // 8).tolist()
    epochs = [seen[0:10], seen[10:20], seen[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and s.epoch == 3


def test_state_dict_round_trip_reproduces_the_next_batches(tmp_path):
    cfg = config(tmp_path, dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)))
    first, _, _ = build_data(cfg, tmp_path, 0, 1)
    for _ in range(7):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # it survives a checkpoint as plain data
    expected = [first.next_batch() for _ in range(80)]  # crosses an epoch boundary
    resumed, _, _ = build_data(cfg, tmp_path, 0, 1)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, [resumed.next_batch() for _ in range(80)], strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert resumed.state_dict() == first.state_dict() and resumed.epoch >= 1
    cfg.data.seq_len = 8
    other, _, _ = build_data(cfg, tmp_path, 0, 1)
    with pytest.raises(ValueError, match="seq_len|n_windows"):
        other.load_state_dict(state)


@pytest.mark.parametrize("dp_size", [2, 3])
def test_dp_shards_union_is_the_single_process_global_batch(tmp_path, dp_size):
    cfg = config(tmp_path, dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)), validation_fraction=0.1)
    ranks = [build_data(cfg, tmp_path, r, dp_size) for r in range(dp_size)]
    cfg.train.micro_batch_size = 4 * dp_size
    single, single_val, _ = build_data(cfg, tmp_path, 0, 1)
    for _ in range(12):
        x, y = single.next_batch()
        parts = [r[0].next_batch() for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
    x, _ = single_val.next_batch()
    assert torch.equal(x, torch.cat([r[1].next_batch()[0] for r in ranks]))
    assert ranks[1][0].state_dict() == single.state_dict()


def test_validation_tail_is_disjoint_from_training_windows(tmp_path):
    cfg = config(tmp_path, dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)), validation_fraction=0.2)
    train, val, _ = build_data(cfg, tmp_path, 0, 1)
    total = len(expected_stream(DOCS))
    assert len(train.tokens) + len(val.tokens) == total and len(val.tokens) == int(total * 0.2)
    np.testing.assert_array_equal(np.concatenate([train.tokens, val.tokens]), expected_stream(DOCS))
    # every training window ends inside the training range
    assert train.n_windows * train.seq_len + 1 <= len(train.tokens)
    positions = Sampler(np.arange(len(train.tokens)), train.seq_len, 4, seed=1)
    for _ in range(positions.n_windows):
        x, y = positions.next_batch()
        assert int(y.max()) < len(train.tokens)
    # validation is read in order and its first state returns to its start (as evaluate() does)
    start = val.state_dict()
    v1 = val.next_batch()[0]
    val.next_batch()
    val.load_state_dict(start)
    assert torch.equal(val.next_batch()[0], v1)
    assert torch.equal(v1[0], torch.from_numpy(np.asarray(val.tokens[:cfg.data.seq_len]).astype(np.int64)))


# --------------------------------------------------------------------------
# Bad inputs: one line, naming the field
# --------------------------------------------------------------------------


def _one_line_error(cfg: TrainerConfig, tmp_path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        build_data(cfg, tmp_path, 0, 1)
    assert "\n" not in str(err.value)
    return err.value


def test_missing_dataset_path(tmp_path):
    err = _one_line_error(config(tmp_path, dataset=str(tmp_path / "nope.jsonl")), tmp_path)
    assert err.field == "data.dataset" and "does not exist" in str(err)
    err = _one_line_error(config(tmp_path, dataset=str(tmp_path / "*.parquet")), tmp_path)
    assert err.field == "data.dataset" and "no files match" in str(err)


@pytest.mark.parametrize("fmt", ["jsonl dir", "parquet", "save_to_disk"])
def test_missing_text_column(tmp_path, fmt):
    err = _one_line_error(config(tmp_path, dataset=_write_format(tmp_path, fmt), text_column="txt"), tmp_path)
    columns = {"jsonl dir": "text, title", "parquet": "text, id", "save_to_disk": "text"}[fmt]
    assert err.field == "data.text_column"
    assert str(err).startswith("data.text_column: column 'txt' not in ") and str(err).endswith(f"(columns: {columns})")


def test_missing_tokenizer_path(tmp_path):
    err = _one_line_error(config(tmp_path, dataset="builtin", tokenizer=str(tmp_path / "tok.json")), tmp_path)
    assert err.field == "data.tokenizer" and "does not exist" in str(err)


def test_model_vocab_smaller_than_tokenizer(tmp_path):
    cfg = config(tmp_path, dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)))
    cfg.model.vocab_size = 1000
    err = _one_line_error(cfg, tmp_path)
    assert err.field == "model.vocab_size" and "set model.vocab_size >= 4096" in str(err)
    gpt2 = cfg.data
    gpt2.tokenizer = "gpt2"
    assert check_tokens(gpt2, 4096, {"n_tokens": 10**6, "vocab_size": 4096}) == int(10**6 * gpt2.validation_fraction)
    with pytest.raises(ConfigError, match="^model.vocab_size: 50000 is smaller .*'gpt2' \\(50257\\)"):
        check_tokens(gpt2, 50000, {"n_tokens": 10**6, "vocab_size": 50257})


def test_other_bad_inputs(tmp_path):
    data = str(write_jsonl(tmp_path / "d.jsonl", DOCS))
    err = _one_line_error(config(tmp_path, dataset=data, validation_split="validation"), tmp_path)
    assert err.field == "data.validation_split" and "single split" in str(err)
    err = _one_line_error(config(tmp_path, dataset=data, seq_len=100_000), tmp_path)
    assert err.field == "data.dataset" and "lower data.seq_len" in str(err)
    err = _one_line_error(config(tmp_path, dataset=data, seq_len=500, validation_fraction=0.01), tmp_path)
    assert err.field == "data.validation_fraction"
    (tmp_path / "d.csv").write_text("text\nhello\n")
    err = _one_line_error(config(tmp_path, dataset=str(tmp_path / "d.csv")), tmp_path)
    assert err.field == "data.dataset" and "not a supported file type" in str(err)


# --------------------------------------------------------------------------
# Hub names, offline: from the local Hugging Face cache, or a clear error
# --------------------------------------------------------------------------


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty HF hub cache in offline mode (no network is tried)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "hf hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_tokenizer_by_name_from_the_local_cache(tmp_path, offline_hub):
    repo = offline_hub / "models--acme--tok"
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    shutil.copy(BUILTIN_TOKENIZER, repo / "snapshots" / ("a" * 40) / "tokenizer.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    cfg = config(tmp_path, dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)), tokenizer="acme/tok")
    train, _, vocab = build_data(cfg, tmp_path, 0, 1)
    assert vocab == 4096
    np.testing.assert_array_equal(all_tokens(train), expected_stream(DOCS))


def test_hub_names_that_cannot_be_loaded(tmp_path, offline_hub):
    err = _one_line_error(config(tmp_path, dataset="no-such-dataset-xyz"), tmp_path)
    assert err.field == "data.dataset" and "could not load 'no-such-dataset-xyz' from the Hugging Face hub" in str(err)
    data = str(write_jsonl(tmp_path / "d.jsonl", DOCS))
    err = _one_line_error(config(tmp_path, dataset=data, tokenizer="acme/missing"), tmp_path)
    assert err.field == "data.tokenizer" and "HF_HUB_OFFLINE=1" in str(err)


def test_state_files_are_read_as_objects_never_blocking_never_whole_when_huge(tmp_path):
    """common/fs.py read_json, the one reader of the JSON state files in shared folders (the token
    cache's locks and error records, the build context's digests, the project's id): what is not an
    object of ours in a regular file is "none", and a FIFO never blocks; the cache's index and resume
    record go by the same rules (fs.load_json), a damaged index said."""
    import threading

    from common.fs import read_json

    (tmp_path / "ok").write_text('{"pid": 7}')
    (tmp_path / "link").symlink_to(tmp_path / "ok")
    (tmp_path / "list").write_text("[1, 2]")
    (tmp_path / "cut").write_text('{"pid": ')
    (tmp_path / "bytes").write_bytes(b'{"a": "\xff"}')
    (tmp_path / "huge").write_text('{"a": "' + "x" * 2048 + '"}')
    os.mkfifo(tmp_path / "fifo")
    assert read_json(tmp_path / "ok") == read_json(tmp_path / "link") == {"pid": 7}
    for name in ("missing", "list", "cut", "bytes", "fifo"):
        assert read_json(tmp_path / name) is None, name
    assert read_json(tmp_path / "huge", limit=1024) is None and read_json(tmp_path / "huge")
    # Through a user's path: the status of a cache whose lock, index and resume record are FIFOs
    # is read at once, the index said to be one with the fix.
    source, tok = _source_and_tok(tmp_path)
    paths = data_cache.cache_paths(source, tok, tmp_path / "c")
    paths.dir.mkdir(parents=True)
    for path in (paths.lock, paths.index, paths.progress):
        os.mkfifo(path)
    found: list = []
    reader = threading.Thread(target=lambda: found.append(
        data_cache.entry_status("train", source, tok, tmp_path / "c")), daemon=True)
    reader.start()
    reader.join(60)
    assert found and found[0].writer is None and found[0].index is None and found[0].partial_tokens == 0
    assert found[0].problem == (f"token cache index {paths.index} is a FIFO, not a regular file: delete it and "
                                f"{paths.bin}, then rerun to tokenize again")
