"""Data prepared before the allocation (`trainer.prepare`): one cache per data,
the trainer only opens it, a killed preparation continues to identical bytes,
and bad input fails in one line."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import trainer.data_sources as data_sources
import trainer.data_tokenize as data_tokenize
from common.errors import ConfigError
from trainer.config import DataSection
from trainer.data_cache import DataCacheError, resolve_cache_dir
from trainer.data_tokenize import load_tokenizer, resolve_tokenizer
from trainer.data_tokenize import Progress
from trainer.prepare import cache_status, main as prepare_main, prepare

ROOT = Path(__file__).resolve().parent.parent
TOK = load_tokenizer(resolve_tokenizer("builtin"))
EOS = TOK.token_to_id("<|endoftext|>")
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Errors should never pass silently.",
             "In the face of ambiguity, refuse the temptation to guess."]
DOCS = [f"Document {i}: " + " ".join(SENTENCES[: 1 + i % 3]) * (1 + i % 4) for i in range(200)]
PROVENANCE = {"prepared_by", "threads", "resumed_from_tokens", "seconds", "created"}  # who and when, not what


def expected_stream(docs: list[str]) -> np.ndarray:
    return np.array([t for d in docs for t in TOK.encode(d, add_special_tokens=False).ids + [EOS]], dtype=np.uint16)


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def only_bin(cache: Path) -> Path:
    (path,) = cache.glob("*.bin")
    return path


def index_without_provenance(bin_path: Path) -> dict:
    index = json.loads(bin_path.with_suffix(".json").read_text())
    return {k: v for k, v in index.items() if k not in PROVENANCE}


# --------------------------------------------------------------------------
# One cache for all runs of the same data; its status without reading data
# --------------------------------------------------------------------------


def test_two_runs_with_the_same_data_share_one_cache(tmp_path, monkeypatch):
    data = str(write_jsonl(tmp_path / "d.jsonl", DOCS))
    project = tmp_path / "project"
    run_a = DataSection(dataset=data, seq_len=16, validation_fraction=0.0)
    run_b = DataSection(dataset=data, seq_len=64, validation_fraction=0.1, num_proc=1)  # cut at read time
    cache = resolve_cache_dir(run_a, project / "runs" / "a")
    # every run of the project finds the same place
    assert cache == resolve_cache_dir(run_b, project / "runs" / "b") == project.resolve() / ".cache" / "tokens"

    before = cache_status(run_a, cache)
    assert not before.prepared and not before.tokenize_in_job and len(before.missing) == 1
    assert "not prepared" in before.describe() and "d.jsonl" in before.describe()
    first = prepare(run_a, cache, num_proc=2)
    assert first.entries[0].tokenized and first.entries[0].index["n_tokens"] == len(expected_stream(DOCS))
    assert "slipway prepare on" in first.entries[0].index["prepared_by"] and "tokenized, " in first.describe()

    status_b = cache_status(run_b, cache)
    assert status_b.prepared and status_b.entries[0].paths.bin == first.entries[0].paths.bin
    assert "prepared, " in status_b.describe()
    monkeypatch.setattr("trainer.data_cache.write_tokens", lambda *a, **k: pytest.fail("tokenized again"))
    second = prepare(run_b, cache)
    assert not second.entries[0].tokenized and second.entries[0].paths.bin == first.entries[0].paths.bin
    assert sorted(p.suffix for p in cache.iterdir()) == [".bin", ".json"]
    np.testing.assert_array_equal(np.fromfile(only_bin(cache), np.uint16), expected_stream(DOCS))


def test_what_the_key_covers(tmp_path):
    """Split, config, text column and tokenizer each make their own entry; seq_len and num_proc do not."""
    base = DataSection(dataset="acme/books", dataset_config="en", split="train", text_column="text")

    def bin_of(**changes) -> Path:
        return cache_status(DataSection(**{**base.__dict__, **changes}), tmp_path).entries[0].paths.bin

    same = {bin_of(), bin_of(seq_len=64, num_proc=3, validation_fraction=0.2, tokenize_in_job=True)}
    assert len(same) == 1
    others = {bin_of(split="test"), bin_of(dataset_config="de"), bin_of(text_column="body"),
              bin_of(tokenizer=str(data_sources.BUILTIN_TOKENIZER.parent)), bin_of(dataset="acme/papers")}
    assert len(others | same) == 6


@pytest.mark.slow
def test_validation_split_is_prepared_too(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS}),
                          "validation": datasets.Dataset.from_dict({"text": DOCS[:20]})}).save_to_disk(
        str(tmp_path / "dd"))
    data = DataSection(dataset=str(tmp_path / "dd"), validation_split="validation")
    result = prepare(data, tmp_path / "c", num_proc=1)
    assert [e.role for e in result.entries] == ["train", "validation"]
    assert [e.index["n_tokens"] for e in result.entries] == [len(expected_stream(DOCS)),
                                                            len(expected_stream(DOCS[:20]))]
    assert cache_status(data, tmp_path / "c").prepared


# --------------------------------------------------------------------------
# The trainer opens a prepared cache, and refuses (or tokenizes) a missing one
# --------------------------------------------------------------------------


def _run_config(tmp_path: Path, data: dict) -> Path:
    """project/runs/r/config.yaml: the tiny model for 2 steps on `data`."""
    from trainer_helpers import tiny_config, write_run

    cfg = tiny_config(model={"vocab_size": 4096}, data={"seq_len": 32, **data},
                      train={"steps": 2, "grad_accum_steps": 1})
    return write_run(tmp_path / "project" / "runs", "r", cfg)


@pytest.mark.slow
def test_prepare_then_train_only_opens_the_cache(tmp_path, monkeypatch, caplog):
    from trainer.train import main as train_main

    data = {"dataset": str(write_jsonl(tmp_path / "d.jsonl", DOCS * 3))}
    config = _run_config(tmp_path, data)
    result = prepare(DataSection(**data), resolve_cache_dir(DataSection(**data), config.parent))
    assert result.entries[0].tokenized

    monkeypatch.setattr("trainer.data_cache.write_tokens", lambda *a, **k: pytest.fail("the trainer tokenized"))
    caplog.set_level(logging.INFO, logger="trainer")
    assert train_main(["--config", str(config)]) == 0
    opened = [r.getMessage() for r in caplog.records if r.getMessage().startswith("opened the token cache")]
    assert len(opened) == 1 and str(result.entries[0].paths.bin) in opened[0]
    assert "prepared by slipway prepare on" in opened[0]
    steps = [json.loads(line) for line in (config.parent / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s.get("kind") == "train"] == [1, 2]


def test_trainer_refuses_a_missing_cache_in_one_line(tmp_path, capsys):
    from trainer.train import main as train_main

    config = _run_config(tmp_path, {"dataset": str(write_jsonl(tmp_path / "d.jsonl", DOCS))})
    assert train_main(["--config", str(config)]) == 2
    # the trainer's own log lines may come first (its logger writes to stderr): one error line, no traceback
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in "\n".join(lines)
    err = errors[0]
    assert err.startswith("error: data.tokenize_in_job: the token cache is not prepared for this run: ")
    assert "d.jsonl (1 json file) with builtin (trainer/assets/tokenizer.json): not prepared" in err and "d.jsonl-" in err
    assert "run `slipway prepare CONFIG`" in err and "set data.tokenize_in_job: true" in err
    assert not list((tmp_path / "project").rglob("*.bin*"))  # nothing was tokenized


@pytest.mark.slow
def test_trainer_tokenizes_in_the_job_when_allowed(tmp_path, caplog):
    from trainer.train import main as train_main

    config = _run_config(tmp_path, {"dataset": str(write_jsonl(tmp_path / "d.jsonl", DOCS * 3)),
                                    "tokenize_in_job": True})
    caplog.set_level(logging.INFO, logger="trainer")
    assert train_main(["--config", str(config)]) == 0
    warned = [r for r in caplog.records if "rank 0 tokenizes it now" in r.getMessage()]
    assert warned and warned[0].levelno == logging.WARNING and "slipway prepare" in warned[0].getMessage()
    assert not [r for r in caplog.records if r.getMessage().startswith("opened the token cache")]
    assert cache_status(DataSection(dataset=str(tmp_path / "d.jsonl")), tmp_path / "project" / ".cache" / "tokens"
                        ).entries[0].index["prepared_by"].startswith("rank 0 of the training job on ")


def test_builtin_data_may_always_be_tokenized_in_the_job(tmp_path):
    assert cache_status(DataSection(), tmp_path).tokenize_in_job
    assert not cache_status(DataSection(dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS))), tmp_path
                            ).tokenize_in_job


# --------------------------------------------------------------------------
# Crashes: nothing that looks complete; a rerun continues to identical bytes
# --------------------------------------------------------------------------

KILL_SCRIPT = """
import sys, time
from pathlib import Path
import trainer.data_sources as s, trainer.data_tokenize as t
from trainer.config import DataSection
from trainer.prepare import prepare
s.BATCH_CHARS = 20_000  # many batches,
t.CHECKPOINT_S = 0.0    # a resume record after each
real_encoder = t._encoder
def slow_encoder(*args):
    encode = real_encoder(*args)
    def slow(texts):
        time.sleep(0.02)  # a few seconds in all, so the kill lands mid-way
        return encode(texts)
    return slow
t._encoder = slow_encoder
prepare(DataSection(dataset=sys.argv[1]), sys.argv[2], num_proc=2)
"""


def recorded_tokens(cache: Path) -> int:
    """Tokens the resume record in `cache` says are written (0 before the first)."""
    for record in cache.glob("*.progress"):
        try:
            return json.loads(record.read_text())["n_tokens"]
        except (OSError, ValueError):
            pass
    return 0


@pytest.mark.slow
def test_killed_preparation_continues_to_identical_bytes(tmp_path):
    corpus = [json.loads(line)["text"] for line in __import__("gzip").open(data_sources.BUILTIN_CORPUS, "rt")]
    data = str(write_jsonl(tmp_path / "d.jsonl", corpus))
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, data, str(killed)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while recorded_tokens(killed) < 150_000:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the preparation never got a third of the way"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    names = sorted(p.name for p in killed.iterdir())
    assert not [n for n in names if n.endswith((".bin", ".json"))], names  # nothing looks complete
    assert [n for n in names if n.endswith(".progress")] and [n for n in names if n.endswith(".lock")]
    status = cache_status(DataSection(dataset=data), killed)
    assert not status.prepared and status.entries[0].writer is None  # its pid is gone: no live writer
    assert 150_000 <= status.entries[0].partial_tokens < 730_974

    resumed = prepare(DataSection(dataset=data), killed, num_proc=1).entries[0]
    assert resumed.tokenized and resumed.index["resumed_from_tokens"] >= 150_000
    reference = prepare(DataSection(dataset=data), clean, num_proc=2).entries[0]
    assert reference.index["resumed_from_tokens"] == 0
    assert resumed.index["n_tokens"] == reference.index["n_tokens"] == 730_974
    assert resumed.paths.bin.read_bytes() == reference.paths.bin.read_bytes()
    assert index_without_provenance(resumed.paths.bin) == index_without_provenance(reference.paths.bin)
    assert sorted(p.suffix for p in killed.iterdir()) == [".bin", ".json"]  # record, partial and lock gone


def _write_format(tmp_path: Path, fmt: str) -> str:
    third = len(DOCS) // 3
    if fmt == "txt files":
        for i, part in enumerate((DOCS[:third], DOCS[third:2 * third], DOCS[2 * third:])):
            (tmp_path / f"{i}.txt").write_text("\n\n".join(part) + "\n")
        return str(tmp_path / "*.txt")
    if fmt == "jsonl files":
        (tmp_path / "d").mkdir()
        write_jsonl(tmp_path / "d" / "0.jsonl", DOCS[:third])
        write_jsonl(tmp_path / "d" / "1.jsonl", DOCS[third:])
        return str(tmp_path / "d")
    if fmt == "json array":
        (tmp_path / "d.json").write_text(json.dumps([{"text": d} for d in DOCS]))
        return str(tmp_path / "d.json")
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), tmp_path / "d.parquet", row_group_size=37)
        return str(tmp_path / "d.parquet")
    if fmt == "save_to_disk":
        import datasets

        datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
        return str(tmp_path / "saved")
    raise AssertionError(fmt)


class Interrupt(BaseException):
    pass


def die_at(k: int):
    """A progress callback that raises on its k-th call: after the k-th batch
    is written and before its resume record (the worst moment to die)."""
    calls = 0

    def show(p: Progress) -> None:
        nonlocal calls
        calls += 1
        if calls == k:
            raise Interrupt

    return show


@pytest.mark.parametrize("fmt", ["txt files", "jsonl files", "json array", "parquet", "save_to_disk"])
def test_interrupted_at_any_batch_then_resumed_gives_identical_bytes(tmp_path, monkeypatch, fmt):
    """Batches of ~500 characters, a resume record after each; the writer dies
    after the k-th batch is written but before its record: the rerun redoes
    that batch and ends with the uninterrupted run's bytes.
    The progress it reports ends at the source's total, resumed or not."""
    data = DataSection(dataset=_write_format(tmp_path, fmt))
    monkeypatch.setattr(data_sources, "BATCH_CHARS", 500)
    monkeypatch.setattr(data_tokenize, "CHECKPOINT_S", 0.0)
    seen: list[Progress] = []
    reference = prepare(data, tmp_path / "clean", num_proc=2, progress=seen.append).entries[0]
    np.testing.assert_array_equal(np.fromfile(reference.paths.bin, np.uint16), expected_stream(DOCS))
    batches = len(seen)
    assert batches > 15 and seen[-1].done == seen[-1].total and seen[-1].tokens == reference.index["n_tokens"]

    resumed_at = []
    for k in (2, batches // 2, batches - 1):
        cache = tmp_path / f"cut{k}"
        with pytest.raises(Interrupt):
            prepare(data, cache, num_proc=2, progress=die_at(k))
        assert not list(cache.glob("*.bin")) and not list(cache.glob("*.json"))
        last: list[Progress] = []
        again = prepare(data, cache, num_proc=1, progress=last.append).entries[0]
        resumed_at.append(again.index["resumed_from_tokens"])
        assert again.paths.bin.read_bytes() == reference.paths.bin.read_bytes(), f"cut after batch {k}"
        assert index_without_provenance(again.paths.bin) == index_without_provenance(reference.paths.bin)
        assert last[-1].done == last[-1].total and last[0].resumed_tokens == resumed_at[-1]
    assert 0 < resumed_at[0] < resumed_at[1] < resumed_at[2] < reference.index["n_tokens"]


def test_a_record_that_does_not_fit_restarts_cleanly(tmp_path, monkeypatch):
    data = DataSection(dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)))
    monkeypatch.setattr(data_sources, "BATCH_CHARS", 500)
    monkeypatch.setattr(data_tokenize, "CHECKPOINT_S", 0.0)
    reference = prepare(data, tmp_path / "clean").entries[0]
    for damage in ("not json", "other inputs", "short partial"):
        cache = tmp_path / damage.replace(" ", "_")
        with pytest.raises(Interrupt):
            prepare(data, cache, progress=die_at(6))
        (record,) = cache.glob("*.progress")
        (partial,) = cache.glob("*.bin.partial")
        if damage == "not json":
            record.write_text("{")
        elif damage == "other inputs":
            record.write_text(json.dumps({**json.loads(record.read_text()), "inputs": {"source": "else"}}))
        else:
            with open(partial, "r+b") as f:
                f.truncate(10)
        with open(partial, "r+b") as f:  # garbage a restart must overwrite
            f.write(b"\xff" * 64)
        again = prepare(data, cache).entries[0]
        assert again.index["resumed_from_tokens"] == 0, damage
        assert again.paths.bin.read_bytes() == reference.paths.bin.read_bytes(), damage


# --------------------------------------------------------------------------
# Progress, the hub path, and bad input
# --------------------------------------------------------------------------


def test_reading_runs_at_most_two_batches_per_thread_ahead(tmp_path, monkeypatch):
    """Memory is bounded by the batches in flight, not by the dataset."""
    data = DataSection(dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS * 5)))
    monkeypatch.setattr(data_sources, "BATCH_CHARS", 500)
    read = [0]
    real_open = data_sources.TextSource.open

    def counting_open(self, *args, **kwargs):
        reader = real_open(self, *args, **kwargs)

        def counted(batches):
            for batch in batches:
                read[0] += 1
                yield batch

        reader.batches = counted(reader.batches)
        return reader

    monkeypatch.setattr(data_sources.TextSource, "open", counting_open)
    ahead = []
    for threads in (1, 3):
        written = [0]

        def show(p: Progress) -> None:
            written[0] += 1
            ahead.append((threads, read[0] - written[0]))

        read[0] = 0
        prepare(data, tmp_path / f"c{threads}", num_proc=threads, progress=show)
        assert written[0] > 100 and read[0] == written[0]
        assert max(a for t, a in ahead if t == threads) == 2 * threads - 1


def test_the_preparation_job_entry_point(tmp_path, capsys):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    data = write_jsonl(tmp_path / "d.jsonl", DOCS)
    (run / "config.yaml").write_text(f"data:\n  dataset: {json.dumps(str(data))}\n  num_proc: 1\n")
    assert prepare_main(["--config", str(run / "config.yaml"), "--check"]) == 1
    assert "not prepared" in capsys.readouterr().out
    assert prepare_main(["--config", str(run / "config.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"{len(expected_stream(DOCS)):,} tokens" in out and str(tmp_path / ".cache" / "tokens") in out
    assert prepare_main(["--config", str(run / "config.yaml"), "--check"]) == 0
    assert "prepared, " in capsys.readouterr().out


def test_progress_bar_on_a_console(tmp_path, monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(data_sources, "BATCH_CHARS", 50_000)
    out = io.StringIO()
    prepare(DataSection(), tmp_path, num_proc=2, progress=Console(file=out, force_terminal=True, width=200))
    text = out.getvalue()
    assert "tokenizing builtin corpus" in text and "100%" in text and "565 docs, 730,974 tokens" in text
    assert "M tok/s" in text and "ETA" in text


def test_progress_lines_in_a_log(tmp_path, monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(data_sources, "BATCH_CHARS", 50_000)
    monkeypatch.setattr(data_tokenize, "LOG_EVERY_S", 0.0)
    out = io.StringIO()
    prepare(DataSection(), tmp_path, num_proc=1, progress=Console(file=out, width=300))
    lines = out.getvalue().splitlines()
    assert len(lines) > 10 and "\x1b" not in out.getvalue()
    assert lines[-1].startswith("data: builtin corpus") and "(100%), 565 documents, 730,974 tokens" in lines[-1]
    assert "M tokens/s" in lines[0] and "s left" in lines[0]


def test_hub_dataset_gets_its_config_and_split(tmp_path, monkeypatch):
    """No network here: `datasets.load_dataset` stands in, to show what prepare asks the hub for."""
    import datasets

    asked = []

    def fake_load_dataset(name, config=None, split=None, **kwargs):
        asked.append((name, config, split))
        return datasets.Dataset.from_dict({"text": DOCS, "title": ["t"] * len(DOCS)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    import trainer.data_sources

    monkeypatch.setattr(trainer.data_sources, "hub_unreachable", lambda: None)  # the hub stands in above
    from rich.console import Console

    data = DataSection(dataset="acme/books", dataset_config="en-v2", split="train")
    bar = io.StringIO()
    result = prepare(data, tmp_path, progress=Console(file=bar, force_terminal=True, width=200))
    assert asked == [("acme/books", "en-v2", "train")]
    assert "tokenizing acme/books/en-v2[train]" in bar.getvalue() and "100%" in bar.getvalue()  # of 200 rows
    assert result.entries[0].source.description == "acme/books/en-v2[train]"
    np.testing.assert_array_equal(np.fromfile(result.entries[0].paths.bin, np.uint16), expected_stream(DOCS))
    assert cache_status(data, tmp_path).prepared  # and the job (no network) finds it by name alone


def test_unreachable_dataset_fails_in_one_line(tmp_path):
    """The real path of a preparation job: `python -m trainer.prepare`, offline, nothing in HF_HOME."""
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  dataset: no-such-org/no-such-dataset\n  dataset_config: v1\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "trainer.prepare", "--config", str(run / "config.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: data.dataset: could not load 'no-such-org/no-such-dataset' from the "
                                  "Hugging Face hub")
    assert "give a local path" in proc.stderr
    assert not list((tmp_path / ".cache" / "tokens").glob("*.bin*"))


def test_bad_input_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.dataset: path .* does not exist"):
        cache_status(DataSection(dataset=str(tmp_path / "missing.jsonl")), tmp_path)
    data = DataSection(dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)), text_column="body")
    with pytest.raises(ConfigError, match=r"^data.text_column: column 'body' not in .*\(columns: text, id\)$"):
        prepare(data, tmp_path / "c")
    assert not list((tmp_path / "c").glob("*.bin*")) and not list((tmp_path / "c").glob("*.progress"))
    with pytest.raises(ConfigError, match="^data.dataset_config: 'v1' names a configuration of a hub dataset, but"):
        cache_status(DataSection(dataset=data.dataset, dataset_config="v1"), tmp_path)
    with pytest.raises(ConfigError, match="^data.num_proc: must be >= 0"):
        prepare(data, tmp_path / "c", num_proc=-1)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="^data.cache_dir: cannot read .*Not a directory"):
        prepare(DataSection(), blocker / "cache")


def test_prepare_imports_no_torch():
    code = "import sys, trainer.prepare; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
                          ).returncode == 0


def test_damaged_entry_is_reported_not_used(tmp_path):
    data = DataSection(dataset=str(write_jsonl(tmp_path / "d.jsonl", DOCS)))
    path = prepare(data, tmp_path / "c").entries[0].paths.bin
    with open(path, "r+b") as f:
        f.truncate(100)
    status = cache_status(data, tmp_path / "c")
    assert not status.prepared and "delete both" in status.describe()
    with pytest.raises(DataCacheError, match="delete both and rerun"):
        prepare(data, tmp_path / "c")
