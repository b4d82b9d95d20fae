"""The config tree: presets, overrides, validation with the rule, the values and the fix."""

from __future__ import annotations

import pytest
import yaml

from jobs.config import dump_config, load_config
from trainer.config import ConfigError, load_trainer_config


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
    assert cfg.train.steps == 7 and cfg.container.mounts == ["/a", "/b"]
    assert cfg.launch.env == {"FOO": "bar baz"} and cfg.run.name == "other"


@pytest.mark.parametrize("overrides, field, words", [
    (["train.stepz=3"], "train.stepz", "valid keys of train are: steps"),
    (["parallel.dp=3"], "parallel", "dp(3) x tp(1) x pp(1) = 3 != nodes(1) x procs_per_node(2) = 2"),
    (["parallel.tp=3", "parallel.dp=1", "launch.procs_per_node=3"], "parallel.tp", "num_heads(4) must be divisible"),
    (["run.name=x$(touch pwned)"], "run.name", "not a safe run name"),
    (["train.steps=many"], "train.steps", "expected an integer"),
    (["slurm.time=soon"], "slurm.time", "not a Slurm time"),
    (["container.runtime=edf", "container.image=images/x.sqsh"], "container.image", "absolute or start with ./"),
    (["container.runtime=edf"], "container.image", "needs an image"),
    (["model.size=huge"], "model.size", "must be one of"),
    (["launch.env.WANDB_API_KEY=abc"], "launch.env.WANDB_API_KEY", "secret"),
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
