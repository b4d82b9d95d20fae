"""The secret policy measured both ways (issue 48; docs/secrets.md states both numbers, which
`test_the_documented_numbers_are_the_measured_ones` holds it to):

- ordinary values and files from real LLM projects are never refused: every identifier a config
  holds (commits, digests, UUIDs, base64 blobs, random path segments) in every field that holds
  identifiers, environment settings under their real names, and a fresh clone tracking a
  tokenizer folder, lock files, a notebook, test fixtures with documented example keys, a README
  with placeholders, a CHANGELOG of commit ids and an env template, which submits;
- every secret shape, in every field and in a tracked file, is refused without being shown or
  written (the cross product through the one config edge is test_secrets.py's), and keys alone in
  files whatever their names;

and the detector's own conventions accept what it gets wrong: a `pragma: allowlist secret` line in
a config, and the project's `.secrets.baseline` made and audited by detect-secrets' own commands,
run as a refusal prints them.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from common.errors import ConfigError
from common.secrets import IDENTIFIER, TEXT, file_findings, refusal
from jobs.config import load_config
from test_secret_policy import BARE, LINE_FORMS, SHAPES, shaped
from conftest import git, squeue_answering, stand_in
from test_secrets import FIELDS
from test_snapshot_hostile import ROOT, SECRET, dry_run, refused

HEX40 = "0e9e39f249a16976918f6564b8830bc894c89659"
HEX64 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
# What a config holds that is no secret, however random it looks (issue 48's seven kinds and more).
IDENTIFIERS = [
    HEX40, "d41d8cd98f00b204e9800998ecf8427e", "3f2504e04f8911d39a0c0305e82c3301",  # a commit, an MD5, a UUID bare
    "3f2504e0-4f89-11d3-9a0c-0305e82c3301", HEX64, "sha256:" + HEX64, "nvcr.io/nvidia/pytorch@sha256:" + HEX64,
    base64.b64encode(json.dumps({"lr": 3e-4, "warmup": 100, "schedule": "cosine"}).encode()).decode(),
    "wandb-run-3kx9q2mz7f8a9b0c1d2e3f4g", "/capstor/scratch/u/tmpAb3Xk9Lq2Zr8Wp5Ty7Mn4Bv6Cx/out",
    "/no-such-top-dir/u/tmpAb3Xk9Lq2Zr8Wp5Ty7Mn4Bv6Cx/out", "/tmp/tmpAb3Xk9Lq2Zr8Wp5Ty7Mn4Bv6Cx/out",
    "models--meta-llama--Llama-3.1-8B/snapshots/" + HEX40, "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B-Instruct",
    "llama3-8b-sft-lr3e-5-bs256-20240501", "nid001234", "x1000c3s2b0n1", "run_7f3c2a91", "ckpt-step-000100000",
]
# Environment settings under their real names (issue 48's 18), and identifiers under names that say so.
SETTINGS = {
    "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "NCCL_IB_PKEY": "0x8014", "UCX_IB_PKEY": "0x8014", "PRIMARY_KEY": "id",
    "SORT_KEY": "length", "KEY_SIZE": "2048", "CACHE_KEY_PREFIX": "slipway", "PASS_THROUGH": "1", "TWO_PASS": "1",
    "NUM_PASS": "2", "AUTH_MODE": "none", "PRIVATE_NETWORK": "0", "SIG_LEVEL": "0.05", "JWT_DISABLED": "true",
    "TOKENIZERS_PARALLELISM": "false", "PAD_TOKEN": "<pad>", "EOS_TOKEN": "</s>", "HF_TOKEN_PATH": "/run/secrets/hf",
    "GIT_COMMIT": HEX40, "MODEL_REVISION": HEX40, "WANDB_RUN_ID": "3kx9q2mz7f8a9b0c1d2e3f4g5h6j", "IMAGE_DIGEST": HEX64,
    "WANDB_RUN_NAME": "wandb-run-3kx9q2mz7f8a9b0c1d2e3f4g", "TRAIN_CONFIG_B64": IDENTIFIERS[7],
    "HF_DATASETS_CACHE": "/capstor/scratch/u/tmpAb3Xk9Lq2Zr8Wp5Ty7Mn4Bv6Cx/hf",
}


def _sets(dotted: str, tp: typing.Any, value: str, name: str = "SOME_NAME") -> tuple[str, dict]:
    origin = typing.get_origin(tp)
    if origin is list:
        return f"{dotted}[0]", {dotted: [value]}
    if origin is dict:
        return f"{dotted}.{name}", {dotted: {name: value}}
    return dotted, {dotted: value}


def _refused_as_secret(sets: dict) -> str:
    """The refusal's line where the config is refused as holding a secret, else ''."""
    try:
        load_config("tiny_cpu", sets=sets)
    except ConfigError as exc:
        return str(exc) if "container.env_from_host: [" in str(exc) else ""
    return ""


def _takes_strings(tp: typing.Any) -> bool:
    origin = typing.get_origin(tp)
    return typing.get_args(tp)[0] is str if origin is list else origin is not dict and str in (tp, *typing.get_args(tp))


def ordinary_value_cases() -> list[tuple[str, dict]]:
    """Each identifier in each field that holds identifiers (a string's), and each setting under its
    name in each field that takes named settings (container.env, launch.env, image.build_args)."""
    cases = [_sets(dotted, tp, value) for dotted, tp, kind in FIELDS for value in IDENTIFIERS
             if kind == IDENTIFIER and _takes_strings(tp)]
    cases += [_sets(dotted, tp, value, name) for dotted, tp, kind in FIELDS for name, value in SETTINGS.items()
              if typing.get_origin(tp) is dict and kind != IDENTIFIER and dotted != "container.annotations"]
    return cases


@pytest.mark.slow
def test_ordinary_values_are_never_refused(project):
    cases = ordinary_value_cases()
    refusals = [(field, line) for field, sets in cases if (line := _refused_as_secret(sets))]
    print(f"\nordinary values: {len(refusals)} refusals of {len(cases)} cases")
    assert len(cases) > 400 and not refusals, refusals[:5]


def test_no_verdict_depends_on_the_machine(project):
    """A path with a random segment under a top directory this machine has, or has not."""
    for top in ("/tmp", "/no-such-top-dir", "/capstor"):
        assert refusal(f"{top}/u/tmpAb3Xk9Lq2Zr8Wp5Ty7Mn4Bv6Cx/out", policy=TEXT) is None, top


# ------------------------------------------------------------------ files of real LLM projects

PNG = "iVBORw0KGgoAAAANSUhEUgAA" + base64.b64encode(__import__("random").Random(4).randbytes(3000)).decode()
LLM_FILES = {
    "tokenizer/added_tokens.json": '{\n  "<|endoftext|>": 151643,\n  "<|im_end|>": 151645,\n'
                                   '  "<|im_start|>": 151644\n}\n',
    "tokenizer/special_tokens_map.json": json.dumps({
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "normalized": False, "rstrip": False},
        "eos_token": "<|eot_id|>", "pad_token": "<|finetune_right_pad_id|>", "unk_token": "[UNK]"}, indent=2),
    "tokenizer/tokenizer_config.json": json.dumps({
        "add_bos_token": True, "added_tokens_decoder": {"128000": {"content": "<|begin_of_text|>", "special": True}},
        "bos_token": "<|begin_of_text|>", "chat_template": "{% for message in messages %}{{ '<|start_header_id|>' + "
        "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{% endfor %}",
        "clean_up_tokenization_spaces": True, "model_max_length": 131072, "pad_token": "<|finetune_right_pad_id|>",
        "tokenizer_class": "PreTrainedTokenizerFast", "use_auth_token": None}, indent=2),
    "tokenizer/tokens.txt": "<pad>\n<s>\n</s>\n<unk>\nĠthe\nĠTransformerEngineLayerNorm\nĠ▁supercalifragilistic\n",
    "tokenizer/special_tokens.yaml": "pad_token: <pad>\nbos_token: <s>\neos_token: </s>\nmask_token: <mask>\n",
    "tokenizer/merges.txt": "#version: 0.2\nĠ t\nĠ a\nh e\ni n\n",
    "uv.lock": 'version = 1\n\n[[package]]\nname = "torch"\nversion = "2.5.1"\nsource = { registry = '
               '"https://pypi.org/simple" }\nwheels = [\n    { url = "https://files.pythonhosted.org/packages/'
               f'torch-2.5.1-cp311-cp311-manylinux1_x86_64.whl", hash = "sha256:{HEX64}", size = 906414124 }},\n]\n',
    "poetry.lock": f'[[package]]\nname = "tokenizers"\nversion = "0.20.3"\nfiles = [\n    {{file = "tokenizers-0.20.3.'
                   f'tar.gz", hash = "sha256:{HEX64}"}},\n]\n\n[metadata]\ncontent-hash = "{HEX64}"\n',
    "requirements.txt": f"torch==2.5.1 \\\n    --hash=sha256:{HEX64}\nsafetensors==0.4.5\n",
    "notebooks/explore.ipynb": json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {"colab": {
        "provenance": []}}, "cells": [{"cell_type": "code", "id": "8f2c1a9e", "execution_count": 3, "metadata": {
            "colab": {"base_uri": "https://localhost:8080/"}, "id": "xJ3k9Lq2Zr8W",
            "outputId": "3f2504e0-4f89-11d3-9a0c-0305e82c3301"}, "source": ["plt.plot(losses)"], "outputs": [
            {"output_type": "display_data", "data": {"image/png": PNG, "text/plain": ["<Figure size 640x480>"]},
             "metadata": {}}, {"output_type": "stream", "name": "stdout", "text": [f"commit {HEX40}\n"]}]}]},
        indent=1),
    "tests/test_s3_upload.py": 'import boto3\n\n# AWS\'s documented example key pair, and jwt.io\'s sample token.\n'
                               'AWS_ACCESS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"\n'
                               'AWS_SECRET_ACCESS_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"\n'
                               'SAMPLE_JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZ'
                               'SI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"\n'
                               '\n\ndef test_client():\n    boto3.client("s3", aws_access_key_id=AWS_ACCESS_KEY_ID)\n',
    "README.md": "# Fine-tuning\n\n```bash\nexport HF_TOKEN=hf_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\nhuggingface-cli "
                 "login --token hf_XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX\nexport WANDB_API_KEY=<your key>\n```\n",
    "CHANGELOG.md": f"# Changelog\n\n## 0.3.0 (2024-05-02)\n- Fix FSDP resume ({HEX40})\n- [`9c1e2b7`](https://"
                    f"github.com/org/repo/commit/{HEX40}) bump torch\n- Revert {HEX40[:12]}\n",
    ".env.example": "HF_TOKEN=\nWANDB_API_KEY=your-wandb-api-key\nOPENAI_API_KEY=sk-...\nHF_HOME=/scratch/$USER/hf\n",
    "kubeconfig.example": "apiVersion: v1\nclusters:\n- cluster:\n    server: https://k8s.example.org:6443\n"
                          "  name: dev\n"
                          "users:\n- name: dev\n  user:\n    token: <your-token>\n",
    "configs/sft.yaml": f"model_name_or_path: meta-llama/Llama-3.1-8B\nrevision: {HEX40}\nrun_name: "
                        "wandb-run-3kx9q2mz7f8a9b0c1d2e3f4g\ndataset: HuggingFaceH4/ultrachat_200k\n",
}


def test_ordinary_files_are_never_refused():
    flagged = {name: [(s.type, s.line_number) for s in found] for name, content in LLM_FILES.items()
               if (found := file_findings(content.encode(), Path(name).name))}
    print(f"\nordinary files: {len(flagged)} refusals of {len(LLM_FILES)}")
    assert not flagged, flagged


def test_a_fresh_clone_tracking_a_tokenizer_folder_submits(checkout, tmp_path, monkeypatch):
    """The project's files as a user tracks them go into the code snapshot of a real submission
    (Slurm's commands stood in), every one of them; a dry run passes the same."""
    ping = 'case "$1" in ping) echo "Slurmctld(primary) at n1 is UP" ;; *) echo n1 ;; esac\n'
    for tool, body in (("sbatch", "echo 4242\n"), ("squeue", squeue_answering("PENDING")), ("scontrol", ping)):
        stand_in(tmp_path / "slurm-bin", tool, body)
    monkeypatch.setenv("PATH", f"{tmp_path / 'slurm-bin'}:{os.environ['PATH']}")
    for name, content in LLM_FILES.items():
        (checkout / "trainer" / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / "trainer" / name).write_text(content)
    git(checkout, "add", "-f", "trainer")
    proc = dry_run(checkout)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "jobs", "submit", "tiny_cpu", "--run-name", "clone"], cwd=checkout,
                          capture_output=True, text=True, timeout=300, env={**os.environ,
                                                                             "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    snapshot = next((checkout / "runs" / ".code").glob("*/trainer/tokenizer/added_tokens.json")).parents[2]
    assert all((snapshot / "trainer" / name).read_text() == content for name, content in LLM_FILES.items())


# ------------------------------------------------------------------ secrets, every shape and sink

def secret_file_cases() -> list[tuple[str, str, str]]:
    """(shape, file name, content): each shape in a tracked file; a bare key alone on a line."""
    cases = []
    for shape in sorted(SHAPES):
        value, body = shaped(shape)
        alone = shape in BARE or shape in LINE_FORMS
        cases.append((shape, "notes.md", f"# notes\n{value}\n" if alone else f"# notes\nsee: {value} here\n"))
    return cases


def test_every_secret_shape_in_a_file_is_found():
    missed = [shape for shape, name, content in secret_file_cases() if not file_findings(content.encode(), name)]
    assert not missed, missed


@pytest.mark.parametrize("name, content", [
    ("wandb_key", secrets.token_hex(20)), ("key.txt", secrets.token_hex(32)), ("ngc_key", "nvapi-" + "aZ3" * 20),
    ("secret_key.txt", next(k for k in iter(lambda: secrets.token_urlsafe(32), None) if refusal(k, policy=TEXT))),
], ids=["wandb_key", "key.txt", "ngc_key", "secret_key.txt"])  # a random value in an id splits xdist's workers
def test_a_key_alone_in_a_file_is_refused_naming_it(checkout, name, content):
    (checkout / "trainer" / name).write_text(content + "\n")
    git(checkout, "add", "-f", "trainer")
    line = refused(dry_run(checkout), f"trainer/{name}", "line 1", "git rm --cached", "-I -m detect_secrets scan",
                   " audit ")
    assert content not in line and not (checkout / "runs").exists()


def test_a_secret_as_a_mapping_s_key_is_never_shown(project):
    for override in (f"container.env.{HEX64}=1", f"launch.env.{SECRET}=1", f"image.build_args.{HEX64}=x"):
        with pytest.raises(ConfigError) as exc:
            load_config("tiny_cpu", [override])
        assert HEX64 not in str(exc.value) and SECRET not in str(exc.value), str(exc.value)


# ------------------------------------------------------------------ the detector's own conventions

def _run(project: Path, command: str, answer: str = "") -> None:
    """A command as the user pastes it into a shell, at the project's top."""
    venv = str(Path(sys.executable).parent)  # never activated: the command names its interpreter
    env = {**os.environ, "PATH": ":".join(p for p in os.environ["PATH"].split(":") if p != venv)}
    proc = subprocess.run(["bash", "-c", command], cwd=project, input=answer, text=True, capture_output=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])


@pytest.mark.parametrize("answer, accepted", [("y\n", True), ("n\n", False), ("s\n", False)])
def test_a_key_is_accepted_once_the_baseline_audits_it_as_none(checkout, answer, accepted):
    """key.txt with a random key: refused naming it and the command to accept it, which, pasted and
    answered (`y`: it should be committed), makes the submission pass; audited as a secret (`n`),
    or not audited (`s`), it is still refused."""
    (checkout / "trainer" / "key.txt").write_text(secrets.token_hex(32) + "\n")
    git(checkout, "add", "trainer")
    line = refused(dry_run(checkout), "trainer/key.txt", "line 1")
    command = re.search(r"`([^`]* -m detect_secrets scan [^`]*)`", line).group(1)
    _run(checkout, command, answer)
    baseline = json.loads((checkout / ".secrets.baseline").read_text())
    assert list(baseline["results"]) == ["trainer/key.txt"], baseline["results"]  # the one finding of the clone
    proc = dry_run(checkout)
    if accepted:
        assert proc.returncode == 0, proc.stderr
    else:
        refused(proc, "trainer/key.txt", *(["audited as one"] if answer == "n\n" else []))


@pytest.mark.slow
def test_a_second_key_is_accepted_into_the_baseline_with_the_first_s_label_kept(checkout):
    """Where the project has a baseline, the command scans it again (detect-secrets' `scan
    --baseline`): the audit asks of the new finding alone, the first one's label stays."""
    for name in ("key.txt", "key2.txt"):
        (checkout / "trainer" / name).write_text(secrets.token_hex(32) + "\n")
        git(checkout, "add", "trainer")
        line = refused(dry_run(checkout), f"trainer/{name}")
        command = re.search(r"`([^`]* -m detect_secrets scan [^`]*)`", line).group(1)
        assert ("--baseline .secrets.baseline" in command) == (name == "key2.txt"), command
        _run(checkout, command, "y\n")
    assert dry_run(checkout).returncode == 0
    labels = json.loads((checkout / ".secrets.baseline").read_text())["results"]
    assert [s["is_secret"] for name in ("trainer/key.txt", "trainer/key2.txt") for s in labels[name]] == [False, False]


def test_a_damaged_baseline_is_named_with_how_to_make_it_again(checkout):
    (checkout / "trainer" / "key.txt").write_text(secrets.token_hex(32) + "\n")
    git(checkout, "add", "trainer")
    (checkout / ".secrets.baseline").write_text('{"results": ')
    refused(dry_run(checkout), ".secrets.baseline", "is not a baseline", "-m detect_secrets scan")


def test_a_config_line_is_accepted_by_its_pragma_and_never_shown(project):
    """A value a text field refuses (a bare 40-hex word, a W&B key's shape) is accepted by
    `# pragma: allowlist secret` on its line, as the refusal's pasteable command writes it; it is
    still masked wherever slipway prints it."""
    raw = yaml.safe_load((project / "configs" / "tiny_cpu.yaml").read_text())
    value = secrets.token_hex(20)
    raw.setdefault("launch", {})["env"] = {"NOTE": value}
    path = project / "configs" / "noted.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "jobs", "submit", "noted", "--dry-run"], cwd=project, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and value not in proc.stdout + proc.stderr, proc.stderr
    number = next(i for i, line in enumerate(path.read_text().splitlines(), 1) if value in line)
    assert f"configs/noted.yaml line {number}" in proc.stderr and "pragma: allowlist secret" in proc.stderr
    _run(project, re.search(r"`(sed [^`]*)`", proc.stderr).group(1))
    assert path.read_text().splitlines()[number - 1].endswith("# pragma: allowlist secret")
    proc = subprocess.run([sys.executable, "-m", "jobs", "submit", "noted", "--dry-run"], cwd=project, text=True,
                          capture_output=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "export NOTE=" in proc.stdout, proc.stderr
    assert value not in proc.stdout + proc.stderr


# ------------------------------------------------------------------ the numbers docs/secrets.md states

def test_the_documented_numbers_are_the_measured_ones():
    doc = (ROOT / "docs" / "secrets.md").read_text()
    shapes_by_field = sum(1 for shape in SHAPES for _, _, kind in FIELDS if shape not in BARE or kind != IDENTIFIER)
    measured = {"ordinary values": len(ordinary_value_cases()), "ordinary files": len(LLM_FILES),
                "secret cases": shapes_by_field + len(SHAPES)}
    stated = {what: int(m.group(1).replace(",", "")) for what in measured
              if (m := re.search(rf"0 of ([\d,]+) {what}", doc))}
    assert stated == measured, (stated, measured)
