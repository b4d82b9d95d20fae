"""metrics.jsonl as an honest history: restart records, the latest value of each step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.metrics_log import latest_by_step, read_metrics

ROOT = Path(__file__).resolve().parent.parent


def train(step: int, loss: float, attempt: int) -> dict:
    return {"kind": "train", "step": step, "loss": loss, "attempt": attempt, "tokens_per_s": 1.0, "mfu": None}


def resumed_history() -> list[dict]:
    """Attempt 1 logs steps 1-5 (eval at 4), checkpoint at 3, dies; attempt 2 resumes at 3,
    logs 4 and dies; attempt 3 resumes at 3 again and logs 4-6."""
    out = [{"kind": "restart", "step": 0}]
    out += [train(s, 10.0 - s, 1) for s in range(1, 6)]
    out.insert(5, {"kind": "eval", "step": 4, "eval_loss": 7.5})
    out += [{"kind": "restart", "step": 3}, train(4, 6.4, 2)]
    out += [{"kind": "restart", "step": 3}, train(4, 6.3, 3), train(5, 5.3, 3), train(6, 4.3, 3)]
    return out


def test_latest_by_step_keeps_the_history_that_stands():
    kept = latest_by_step(resumed_history())
    assert [(r["kind"], r["step"], r.get("attempt")) for r in kept] == [
        ("train", 1, 1), ("train", 2, 1), ("train", 3, 1), ("train", 4, 3), ("train", 5, 3), ("train", 6, 3)]
    # The eval at step 4 was undone by the restart at 3 and not logged again: gone.


def test_a_restart_drops_later_steps_no_later_attempt_reached():
    records = [train(s, 1.0, 1) for s in range(1, 9)] + [{"kind": "restart", "step": 4}, train(5, 2.0, 2)]
    assert [(r["step"], r["attempt"]) for r in latest_by_step(records)] == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2)]
    # Without restart records (files written before they existed) the latest line of a step wins.
    old = [train(1, 1.0, 1), train(2, 1.0, 1), train(2, 0.5, 2), {"kind": "eval", "step": 2}, {"no": "step"}]
    assert [(r["kind"], r["step"], r.get("attempt")) for r in latest_by_step(old)] == [
        ("train", 1, 1), ("train", 2, 2), ("eval", 2, None)]


def test_read_metrics_skips_a_line_cut_by_a_crash(tmp_path):
    lines = [json.dumps(r) for r in resumed_history()]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "train", "st')
    assert read_metrics(tmp_path) == resumed_history()
    from common.errors import ConfigError

    with pytest.raises(ConfigError, match="has not logged a step"):
        read_metrics(tmp_path / "nope")


def test_history_and_plot_import_no_torch():
    """`slipway status` and `slipway plot` run on the login node, which may have no torch."""
    code = ("import sys, common.metrics_log, trainer.plot; "
            "bad = [m for m in ('torch', 'numpy', 'jobs') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_plot_draws_each_step_once(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    records = resumed_history() + [{"kind": "train", "step": 7, "loss": None, "tokens_per_s": 1.0, "mfu": None}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn = []
    original = matplotlib.axes.Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((kwargs.get("label"), list(args[0]), list(args[1])))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    from trainer.plot import plot_run

    assert plot_run(tmp_path).is_file()
    loss = next(d for d in drawn if d[0] == "train")
    assert loss[1] == [1, 2, 3, 4, 5, 6]  # in step order, once each; step 7's null loss left out
    assert loss[2] == [9.0, 8.0, 7.0, 6.3, 5.3, 4.3]
