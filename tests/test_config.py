"""The config tree: presets, overrides, validation with the rule, the values and the fix."""

from __future__ import annotations

import pytest
import yaml

from jobs.config import dump_config, load_config
from common.errors import ConfigError
from trainer.config import load_trainer_config


def write(tmp_path, data: dict, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_tiny_wikitext_is_the_tutorial_run():
    cfg = load_config("configs/tiny_wikitext.yaml")
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads) == (768, 1536, 12, 12, 12)
    assert (m.vocab_size, m.max_position_embeddings, m.tie_embeddings) == (50257, 512, True)
    assert 105e6 < m.num_params() < 115e6  # the tutorial's "109M"
    assert (p.dp, p.tp, p.pp, p.zero_stage) == (2, 4, 1, 1)
    assert (cfg.slurm.nodes, cfg.slurm.gpus_per_node, cfg.world_size) == (2, 4, 8)
    assert (t.micro_batch_size, d.seq_len, t.steps, t.lr, t.min_lr, t.warmup_steps) == (64, 512, 1500, 1e-3, 1e-5, 150)
    assert (t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_clip, t.dtype) == (0.9, 0.95, 1e-8, 0.01, 1.0, "bfloat16")
    assert (d.dataset, d.dataset_config, d.tokenizer) == ("wikitext", "wikitext-103-v1", "gpt2")
    assert cfg.checkpoint.interval == 1500 and cfg.container.runtime == "edf"
    assert cfg.run.name == "tiny_wikitext"


def test_presets_and_custom_dimensions(tmp_path):
    cfg = load_config(write(tmp_path, {"model": {"size": "small", "num_layers": 3}, "container": {"runtime": "none"},
                                       "slurm": {"gpus_per_node": 1}}))
    assert cfg.model.hidden_size == 1024 and cfg.model.num_layers == 3
    with pytest.raises(ConfigError, match=r"model\.hidden_size.*custom"):
        load_config(write(tmp_path, {"model": {"size": "custom"}, "container": {"runtime": "none"}}))


def test_overrides_and_named_sets(tmp_path):
    cfg = load_config("tiny_cpu", ["train.steps=7", "container.mounts=[/a, /b]", "launch.env.FOO=bar baz"],
                      {"run.name": "other"})
    assert cfg.train.steps == 7 and [m.spec() for m in cfg.container.mounts] == ["/a:/a", "/b:/b"]
    assert cfg.launch.env == {"FOO": "bar baz"} and cfg.run.name == "other"


@pytest.mark.parametrize("overrides, field, words", [
    (["train.stepz=3"], "train.stepz", "valid keys of train are: steps"),
    (["parallel.dp=3"], "parallel", "dp(3) x tp(1) x pp(1) = 3 != nodes(1) x procs_per_node(2) = 2"),
    (["parallel.tp=3", "parallel.dp=1", "launch.procs_per_node=3"], "parallel.tp", "num_heads(4) must be divisible"),
    (["run.name=x$(touch pwned)"], "run.name", "not a safe run name"),
    (["train.steps=many"], "train.steps", "expected an integer"),
    (["slurm.time=soon"], "slurm.time", "not a Slurm time"),
    (["slurm.time=1:2:3:4"], "slurm.time", "MM, MM:SS, HH:MM:SS, D-HH"),
    (["slurm.time=00:05:00", "slurm.signal_seconds=300"], "slurm.signal_seconds", "at least half of slurm.time"),
    (["slurm.max_requeues=-1"], "slurm.max_requeues", ">= 0"),
    (["container.runtime=edf", "container.image=images/x.sqsh"], "container.image", "absolute or start with ./"),
    (["train.compile=yes"], "train.compile", "expected true or false, got 'yes'"),
    (["train.steps=0x"], "train.steps", "expected an integer, got '0x'"),
    (["container.mounts=/a"], "container.mounts", "expected a list such as [a, b]"),
    (["container.mounts=[/a"], "container.mounts", "not valid YAML"),
    (["model.size=huge"], "model.size", "must be one of"),
    (["launch.env.WANDB_API_KEY=abc123"], "launch.env.WANDB_API_KEY", "secret"),
    (["trainsteps=3"], "trainsteps", "section.key=value"),
    (["parallel.pp=2", "parallel.dp=1"], "model.tie_embeddings", "pipeline"),
])
def test_bad_input_names_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as exc:
        load_config("tiny_cpu", overrides)
    assert exc.value.field == field
    assert words in str(exc.value)
    assert "\n" not in str(exc.value)


def test_resolved_config_round_trips_and_trainer_reads_it(tmp_path):
    cfg = load_config("tiny_wikitext")
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    again = load_config(path)
    assert dump_config(again) == dump_config(cfg)
    tcfg = load_trainer_config(path)
    assert tcfg.model == cfg.model and tcfg.train == cfg.train and tcfg.run == cfg.run


def test_unknown_config_lists_known(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="known configs: .*tiny_cpu"):
        load_config("nope")


@pytest.mark.parametrize("override, field, value", [
    ("slurm.time=10:00", "time", "10:00"),  # YAML 1.1 read this as 600
    ("slurm.account=0123", "account", "0123"),  # ... and this as 83
    ("slurm.account=yes", "account", "yes"),  # ... and this as true
    ("slurm.account=#x", "account", "#x"),  # ... and dropped this as a comment
    ("slurm.account=a: b", "account", "a: b"),
    ("slurm.account=", "account", None),  # empty: unset
    ("slurm.partition=null", "partition", None),
])
def test_override_values_stay_what_was_typed(override, field, value):
    assert getattr(load_config("tiny_cpu", [override]).slurm, field) == value


def test_yaml_scalars_are_typed_by_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("container: {runtime: none}\nslurm:\n  time: 10:00\n  account: 0123\n  qos: yes\n"
                    "  nodes: 0x2\n  gpus_per_node: 0\ntrain:\n  lr: 1e-3\n  compile: TRUE\n"
                    "launch:\n  env: {A: 010, B: on, C: '3'}\n  procs_per_node: 2\nparallel: {dp: 4}\n")
    cfg = load_config(path)
    assert (cfg.slurm.time, cfg.slurm.account, cfg.slurm.qos, cfg.slurm.nodes) == ("10:00", "0123", "yes", 2)
    assert cfg.slurm.time_seconds() == 600  # MM:SS, as Slurm reads it
    assert (cfg.train.lr, cfg.train.compile) == (1e-3, True)
    assert cfg.launch.env == {"A": "010", "B": "on", "C": "3"}
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))  # the frozen config means the same when read back
    assert dump_config(load_config(again)) == dump_config(cfg)
    assert load_trainer_config(again).train == cfg.train


@pytest.mark.parametrize("text, where, words", [
    ("train:\n  steps: 3\nslurm:\n  nodes: 1\ntrain:\n  dtype: float32\n", "line 5",
     "duplicate key 'train' (first at line 1)"),
    ("train:\n  steps: 3\n  steps: 4\n", "line 3", "duplicate key 'steps' (first at line 2)"),
    ("train: [\n", "line 2", "not valid YAML"),
    ("train:\n  steps: 3\n 1: 2\n", "line 3", "not valid YAML"),
])
def test_yaml_file_errors_name_the_line(tmp_path, text, where, words):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert str(exc.value).startswith(f"{path} {where}: ") and words in str(exc.value), str(exc.value)
    assert "\n" not in str(exc.value)


def test_empty_config_file_says_so(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="empty.yaml is empty"):
        load_config(tmp_path / "empty.yaml")


def test_config_names_and_paths(tmp_path):
    assert load_config("tiny_cpu.yaml").run.name == "tiny_cpu"
    assert load_config("configs/tiny_cpu.yaml").run.name == "tiny_cpu"
    with pytest.raises(ConfigError) as exc:
        load_config("x" * 300)
    assert "File name too long" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("text, seconds", [
    ("45", 2700), ("45:30", 2730), ("01:00:00", 3600), ("2-0", 172800), ("2-03", 183600),
    ("1-02:03", 93780), ("1-02:03:04", 93784), ("UNLIMITED", None), ("infinite", None),
])
def test_every_slurm_time_form(text, seconds):
    cfg = load_config("tiny_cpu", [f"slurm.time={text}"])
    assert cfg.slurm.time_seconds() == seconds


@pytest.mark.parametrize("time, signal, warning, bounds", [
    # Slurm's own warning is the measured lead's floor; the lead starts at a tenth of the limit (at
    # most 300 s) until saves are measured, and never takes more than half the limit.
    ("00:05:00", None, 30, (30, 30, 150)),  # a tenth of a short job, not the 300 s that would stop it at once
    ("01:00:00", None, 60, (60, 300, 1800)), ("UNLIMITED", None, 300, None), ("00:00:15", None, 0, None),
    ("00:10:00", "120", 120, None), ("00:10:00", "0", 0, None),  # fixed: Slurm's --signal alone
])
def test_time_limit_warning_fits_inside_the_limit(time, signal, warning, bounds):
    overrides = [f"slurm.time={time}"] + ([f"slurm.signal_seconds={signal}"] if signal else [])
    slurm = load_config("tiny_cpu", overrides).slurm
    assert (slurm.warning_seconds(), slurm.warning_bounds()) == (warning, bounds)
