"""The flagship, as it ships, on this machine's CPUs: configs/tiny_wikitext.yaml's model
(size tiny: vocab 50257 padded to 50304, tied embeddings, 109M parameters) and layout
(tp=4 x dp=2, FSDP, 2 nodes x 4 GPUs) launched by `slipway local` as 8 gloo processes,
with the builtin corpus and tokenizer (no network), a short context, fp32 and 4 steps
(the only overrides).

One process with the same global batch is the reference; the flagship's sharded
checkpoint of step 2 then resumes in one process (the crash after step 2 is made by
removing step 4's checkpoint) and must continue as the uninterrupted run did.
About 2 minutes on 2 cores; the 1.4 GB checkpoints are removed as soon as they are not needed.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.rundir import complete_checkpoints

from trainer.checkpoint import step_dir
from common.metrics_log import latest_by_step, read_metrics
from trainer_helpers import ROOT, clean_env

pytestmark = pytest.mark.multiproc

# fp32 on CPU: the layouts differ only in summation order (tp-split matmuls, sharded
# reductions, the tied embedding's two gradients added in another order). Measured over
# these 4 steps: losses agree to 1.3e-6 relative, gradient norms to 1.7e-4 (Adam turns
# rounding in near-zero gradients into whole lr-sized steps, and the norm sees them first).
LOSS_RTOL = 2e-5
GRAD_NORM_RTOL = 2e-3

OVERRIDES = ["data.dataset=builtin", "data.dataset_config=", "data.tokenizer=builtin", "data.seq_len=32", "train.steps=4",
             "train.warmup_steps=1", "train.dtype=float32", "checkpoint.interval=2", "checkpoint.keep_last=3"]
# The same config as one process: one node, one rank, no GH200 node preset (it wants 4 ranks).
ONE_PROCESS = ["--nodes", "1", "--gpus-per-node", "1", "--dp", "1", "--tp", "1", "launch.preset=none",
               "train.micro_batch_size=2"]


def slipway_local(project: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "jobs", "local", "tiny_wikitext", *args]
    proc = subprocess.run(cmd, cwd=project, env=clean_env(SLIPWAY_PROJECT=str(project)), capture_output=True,
                          text=True, timeout=420)
    if proc.returncode != 0:  # the ranks' own errors first: torchrun's summary buries them
        errors = dict.fromkeys(line for line in (proc.stdout + proc.stderr).splitlines()
                               if re.search(r"(?i)error: |Error$", line) and "ChildFailedError" not in line)
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}; its errors:\n" + "\n".join(list(errors)[:20]) +
                    f"\n... the end of its output:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in latest_by_step(read_metrics(run_dir)) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def flagship(tmp_path_factory):
    project = tmp_path_factory.mktemp("flagship") / "a project"
    (project / "configs").mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "tiny_wikitext.yaml", project / "configs")
    runs = project / "runs"
    try:
        out = {"reference": slipway_local(project, "--run-name", "reference", *ONE_PROCESS, *OVERRIDES)}
        shutil.rmtree(runs / "reference" / "checkpoints")  # only its losses are compared
        out["flagship"] = slipway_local(project, "--run-name", "flagship", "train.micro_batch_size=1", *OVERRIDES)
        ckpt = runs / "flagship" / "checkpoints"
        out["saved"] = complete_checkpoints(ckpt)
        out["frozen"] = yaml.safe_load((runs / "flagship" / "config.yaml").read_text())
        out["shapes"] = _shapes(step_dir(ckpt, 2))
        shutil.rmtree(step_dir(ckpt, 4))  # the run "died" after its step-2 checkpoint
        out["resumed"] = slipway_local(project, "--run-name", "flagship", "--force", *ONE_PROCESS, *OVERRIDES)
        out["runs"] = runs
        yield out
    finally:  # 1.4 GB a checkpoint: never left in pytest's kept temp dirs, whatever failed
        for run in runs.glob("*"):
            shutil.rmtree(run / "checkpoints", ignore_errors=True)


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {name: tuple(md.size) for name, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}


def test_the_flagship_runs_its_own_model_and_layout(flagship):
    frozen = flagship["frozen"]
    assert frozen["model"]["size"] == "tiny" and frozen["model"]["vocab_size"] == 50257
    assert frozen["model"]["tie_embeddings"] is True and frozen["model"]["pad_vocab_multiple"] == 64
    assert {k: frozen["parallel"][k] for k in ("dp", "tp", "pp", "dp_mode")} == {"dp": 2, "tp": 4, "pp": 1,
                                                                                 "dp_mode": "fsdp"}
    log = flagship["flagship"].stdout + flagship["flagship"].stderr
    assert "world 8 = pp 1 x dp 2 x tp 4 on cpu (gloo), torch.float32, attention sdpa" in log
    assert "returned a view tensor" not in log
    shapes = flagship["shapes"]
    assert shapes["model.tok_embeddings.weight"] == (50304, 768)  # padded rows, saved whole
    n_params = sum(math.prod(s) for n, s in shapes.items() if n.startswith("model.") and n != "model.output.weight")
    assert n_params == 109_431_552  # 109M with the 47 padded rows; the output is the tied embedding


def test_flagship_losses_match_one_process(flagship):
    ref = train_records(flagship["runs"] / "reference")
    assert [r["step"] for r in ref] == [1, 2, 3, 4]
    # The flagship's own four steps: the first four train records (the resumed process adds 3-4 again).
    flag_first = [r for r in read_metrics(flagship["runs"] / "flagship") if r["kind"] == "train"][:4]
    assert [r["step"] for r in flag_first] == [1, 2, 3, 4]
    for g, w in zip(flag_first, ref):
        assert g["loss"] == pytest.approx(w["loss"], rel=LOSS_RTOL), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=GRAD_NORM_RTOL), f"step {g['step']}"
        assert g["lr"] == pytest.approx(w["lr"], rel=1e-12)
    assert ref[0]["loss"] - ref[-1]["loss"] > 0.5  # it learns: a resume that lost state would show
    assert flagship["saved"] == [2, 4]


def test_flagship_checkpoint_resumes_in_one_process(flagship):
    """The tp x dp-sharded checkpoint of step 2 loads into one process; steps 3 and 4 then
    are the uninterrupted reference's, and metrics.jsonl says where the history restarted."""
    run = flagship["runs"] / "flagship"
    assert "world 1 = pp 1 x dp 1 x tp 1 on cpu (no process group)" in flagship["resumed"].stdout + flagship["resumed"].stderr
    restarts = [r for r in read_metrics(run) if r["kind"] == "restart"]
    assert [(r["step"], r["world_size"], r["dp"], r["tp"]) for r in restarts] == [(0, 8, 2, 4), (2, 1, 1, 1)]
    raw_steps = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    assert raw_steps == [1, 2, 3, 4, 3, 4]  # steps 3-4 logged twice: the file is the whole story
    history, ref = train_records(run), train_records(flagship["runs"] / "reference")
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    for g, w in zip(history[2:], ref[2:]):
        assert g["loss"] == pytest.approx(w["loss"], rel=LOSS_RTOL), f"resumed step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=GRAD_NORM_RTOL), f"resumed step {g['step']}"
    assert complete_checkpoints(run / "checkpoints") == [2, 4]
    assert json.loads((step_dir(run / "checkpoints", 4) / "COMPLETE").read_text())["world_size"] == 1
