"""The parts of `slipway gpu-check` (jobs/gpucheck/__init__.py says what each does) and the
command itself: the tiny model's configs, the processes each part starts, what it checks."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from common.errors import ConfigError, failure_line
from common.fs import existing_parent, read_json, write_atomic
from common.metrics_log import read_metrics
from common.rundir import RunDir, complete_checkpoints
from jobs.gpucheck.check import BUDGETS, Check, Part, Plan

BF16_LOSS_RTOL = 5e-3  # tests/test_gpu.py's: bf16 autocast against fp32, 10x the CPU's own difference
# A dp x tp run against the dp run: fp32 layouts agree to 2e-7 over 8 steps on the CPU; bf16 moves
# by its rounding in other reduction orders.
LAYOUT_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}
STEPS, SAVED = 8, 4  # the training part's run, and the checkpoint its resume starts from


def gpu_check(out: Path, device: str = "auto", budgets: Optional[dict[str, float]] = None, console=None) -> int:
    """Run the check into `out`; 0 when every check that ran passed, 1 otherwise."""
    out = out.absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file: give a directory (it is created if missing)")
    if not os.access(existing_parent(out), os.W_OK):
        raise ConfigError("--out", f"{existing_parent(out)} is not writable here: give a directory you can write")
    check = GpuCheck(out, {**BUDGETS, **(budgets or {})}, console)
    with check.claimed():
        node, t0 = check.part("node"), time.monotonic()
        with tempfile.TemporaryDirectory(prefix="slipway-gpu-check-") as empty:  # no package in the cwd to shadow ours
            info = check.run_json(node, "probe", [sys.executable, "-m", "trainer.gpucheck", "node"], cwd=Path(empty),
                                  write_log=False)
        cuda = bool(info and info.get("cuda_available"))
        if device == "cuda" and not cuda:
            raise ConfigError("--device", "torch sees no CUDA device on this node" + (
                f" (torch {info['torch']}, built for CUDA {info['torch_cuda'] or 'none'})" if info else "") +
                ": run it on a GPU node, or --device cpu to check the rest on the CPU")
        check.start(device if device != "auto" else "cuda" if cuda else "cpu", len(info["gpus"]) if cuda else 0)
        check.node(node, info, t0)
        for name, plan in (("correctness", check.plan_correctness), ("training", check.plan_training),
                           ("allreduce", check.plan_allreduce), ("speed", check.plan_speed)):
            check.run_part(name, plan())
    return 1 if any(not c["ok"] for p in check.parts for c in p.checks) else 0


class GpuCheck(Check):
    """The check's parts on this node: `plan_NAME` lists part NAME's steps (gpu_check runs them in order)."""

    def node(self, part: Part, info: Optional[dict], t0: float) -> None:
        if info is not None:
            part.results = {**info, "environment": self.environment()}
            part.check("torch", info["torch_supported"], f"torch {info['torch']} (slipway supports 2.10 to 2.13)")
            if self.device == "cuda":
                names = sorted({g["name"] for g in info["gpus"]})
                part.check("GPUs", bool(names), f"{len(info['gpus'])} x {', '.join(names) or 'none'}")
                part.check("kernels", not info["unserved"], "torch carries kernels for every GPU" if not
                           info["unserved"] else f"torch {info['torch']} has no kernels for compute capability "
                           f"{', '.join(info['unserved'])} (it has {' '.join(info['torch_archs'])})")
                flash = info["flash_attn"] or ""
                part.check("flash-attn", not flash.startswith("broken"), flash or "not installed (SDPA is used)")
        self.finish(part, t0)

    def environment(self) -> dict[str, str]:
        """What `slipway local` exports for the training part's ranks (as the batch script, less a preset's)."""
        from jobs.config import load_config
        from jobs.interactive import local_env
        from jobs.runs import Run

        cfg = load_config(str(self.training_config("gpucheck-dp", dp=self.devices, tp=1)), [])
        return dict(sorted(local_env(cfg, Run(RunDir(self.runs / cfg.run.name, self.work))).items()))

    @property
    def runs(self) -> Path:
        return self.work / "runs"

    def trainer_sections(self, steps: int, dtype: str) -> dict[str, Any]:
        """The tiny model on the shipped corpus and tokenizer, every step logged, compile off (speed
        measures it), the hang watchdog on (the trainer's default)."""
        return {"model": dict(size="custom", hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                              num_kv_heads=2, vocab_size=4096, max_position_embeddings=128, tie_embeddings=False,
                              init_std=0.02),
                "data": {"dataset": "builtin", "tokenizer": "builtin", "seq_len": 128,
                         "cache_dir": str(self.work / "tokens")},
                "train": {"steps": steps, "micro_batch_size": 4, "grad_accum_steps": 1, "lr": 3e-3, "min_lr": 3e-4,
                          "warmup_steps": 2, "dtype": dtype, "compile": False, "eval_interval": 0},
                "logging": {"interval": 1}}

    def training_config(self, name: str, dp: int, tp: int, accum: int = 1) -> Path:
        """A `slipway local` config of the tiny model over dp x tp processes, saving every SAVED steps;
        a global batch of dp x `accum` micro batches."""
        raw = {"run": {"name": name, "seed": 11}, **self.trainer_sections(STEPS, "auto"),
               "slurm": {"nodes": 1, "gpus_per_node": 0}, "container": {"runtime": "none"}, "code": {"snapshot": False},
               "launch": {"launcher": "torchrun", "procs_per_node": dp * tp, "python": sys.executable},
               "parallel": {"dp": dp, "tp": tp, "pp": 1, "dp_mode": "fsdp"},
               "checkpoint": {"interval": SAVED, "keep_last": 3}}
        raw["train"]["grad_accum_steps"] = accum
        return write_atomic(self.work / "configs" / f"{name}.yaml", yaml.safe_dump(raw, sort_keys=False))

    def plan_correctness(self) -> Plan:
        return [("fp32 on the CPU", lambda part: self.trainer_losses(part, "fp32 on the CPU", "float32", cpu=True)),
                (f"bf16 on the {self.device.upper()}", self.bf16_against_fp32),
                ("attention kernels", self.attention)]

    def trainer_losses(self, part: Part, what: str, dtype: str, cpu: bool) -> None:
        name = "fp32-cpu" if cpu else f"bf16-{self.device}"
        raw = {"run": {"name": name, "seed": 7}, **self.trainer_sections(12, dtype),
               "parallel": {"dp": 1, "tp": 1, "pp": 1}, "checkpoint": {"interval": 10**6}}
        config = write_atomic(self.work / "correctness" / name / "config.yaml", yaml.safe_dump(raw, sort_keys=False))
        rc, output = self.run(part, what, [sys.executable, "-m", "trainer", "--config", str(config)],
                              env={**({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}),
                                   "OMP_NUM_THREADS": "1" if self.device == "cpu" else "4"})
        part.results[what] = losses = (_attempts(config.parent) or [{}])[-1] if rc == 0 else {}
        _trained(part, f"the trainer, {what}", rc, output, losses, range(1, 13),
                 f"12 steps, loss {losses.get(1, 0):.4f} -> {losses.get(12, 0):.4f}")

    def bf16_against_fp32(self, part: Part) -> None:
        what = f"bf16 on the {self.device.upper()}"
        self.trainer_losses(part, what, "bfloat16", cpu=False)
        ref, got = part.results.get("fp32 on the CPU") or {}, part.results.get(what) or {}
        if ref and got:
            worst = _worst(got, ref)
            part.check("bf16 against the fp32 reference", worst <= BF16_LOSS_RTOL and ref[1] - ref[12] > 0.3,
                       f"the losses of 12 steps within {worst:.1e} of fp32's (bound {BF16_LOSS_RTOL:g}), "
                       f"fp32 learned {ref[1] - ref[12]:.2f}")

    def attention(self, part: Part) -> None:
        result = self.run_json(part, "attention kernels", [sys.executable, "-m", "trainer.gpucheck", "attention",
                                                           "--device", self.device])
        if result is None:
            return
        part.results["attention"] = result
        for name, kernel in result["kernels"].items():
            detail = kernel.get("error") or ", ".join(f"{k} {v['error']:.3g} (bound {v['bound']:.3g})"
                                                      for k, v in kernel["errors"].items())
            part.check(f"{name} against the math path", kernel["ok"], detail)
        if not result["flash_attn"] or self.device == "cpu":
            part.skip("flash-attn against the math path", "flash-attn runs on CUDA only" if result["flash_attn"]
                      else "flash-attn is not installed here")

    def plan_training(self) -> Plan:
        n = self.devices
        tp = ("dp x tp", self.layouts if n % 2 == 0 else
              "one GPU: no tensor parallel layout to try" if n == 1 else f"{n} GPUs: no dp x tp 2 of the same batch")
        return [(f"FSDP2 over {n}", self.first_attempt), (f"resumed from step {SAVED}", self.resume), tp]

    def local(self, part: Part, what: str, config: Path) -> tuple[int, str]:
        env = {"SLIPWAY_PROJECT": str(self.work), "SLIPWAY_RUNS": str(self.runs), "COLUMNS": "200"}
        return self.run(part, what, [sys.executable, "-m", "jobs", "local", str(config)], env=env, interrupt=True)

    def first_attempt(self, part: Part) -> None:
        what, run = f"FSDP2 over {self.devices}", RunDir(self.runs / "gpucheck-dp")
        rc, output = self.local(part, what, self.training_config("gpucheck-dp", dp=self.devices, tp=1))
        losses = (_attempts(run.path) or [{}])[0]
        part.results["losses"] = {"first attempt": losses}
        saved = complete_checkpoints(run.path / "checkpoints")
        hangs = sorted(p.name for p in run.hangs.glob("*.txt"))
        progress = read_json(run.progress) or {}
        _trained(part, f"slipway local, {what}", rc, output, losses, range(1, STEPS + 1),
                 f"{STEPS} steps, loss {losses.get(1, 0):.4f} -> {losses.get(STEPS, 0):.4f}")
        part.check("checkpoints", saved == [SAVED, STEPS], f"complete at steps {saved or 'none'}")
        part.check("hang watchdog", not hangs and progress.get("step") == STEPS and progress.get("hang_timeout", 0) > 0,
                   f"on (train.hang_timeout {progress.get('hang_timeout')} s), no hang; progress.json at step "
                   f"{progress.get('step')}" if not hangs else f"hang dumps: {', '.join(hangs)}")

    def resume(self, part: Part) -> None:
        """The run again, its last checkpoint lost (as a crash before it was written leaves it): it
        resumes from step SAVED, and steps SAVED+1.. must repeat the first attempt's losses."""
        run, what = self.runs / "gpucheck-dp", f"resumed from step {SAVED}"
        last = run / "checkpoints" / f"step-{STEPS:06d}"
        if not last.is_dir():
            part.check(what, False, f"{last} is not there: the first attempt did not save it")
            return
        shutil.rmtree(last)
        rc, output = self.local(part, what, self.work / "configs" / "gpucheck-dp.yaml")
        first, second = (_attempts(run) + [{}, {}])[:2]
        part.results["losses"]["resumed"] = second
        if not _trained(part, f"slipway local, {what}", rc, output, second, range(SAVED + 1, STEPS + 1),
                        f"steps {SAVED + 1}-{STEPS} trained again"):
            return
        same, worst = all(second[s] == first.get(s) for s in second), _worst(second, first)
        tolerance = 0.0 if self.device == "cpu" else LAYOUT_RTOL["bfloat16"] / 10
        part.check("exact resume", same or worst <= tolerance,
                   f"the losses of steps {SAVED + 1}-{STEPS} are the first attempt's, bit for bit" if same else
                   f"the losses of steps {SAVED + 1}-{STEPS} differ from the first attempt's by up to {worst:.1e} "
                   f"(bound {tolerance:g}{': GPU kernels that accumulate in another order' if tolerance else ''})")

    def layouts(self, part: Part) -> None:
        """dp x tp 2 trains what dp alone does on the same global batch (twice the accumulation), to rounding."""
        dp, dtype = self.devices // 2, "bfloat16" if self.device == "cuda" else "float32"
        rc, output = self.local(part, "dp x tp", self.training_config("gpucheck-tp", dp=dp, tp=2, accum=2))
        got = (_attempts(self.runs / "gpucheck-tp") or [{}])[0]
        part.results["losses"][f"dp {dp} x tp 2"] = got
        ref = part.results["losses"].get("first attempt") or {}
        if _trained(part, f"slipway local, dp {dp} x tp 2", rc, output, got, range(1, STEPS + 1), f"{STEPS} steps") \
                and ref:
            worst = _worst(got, ref)
            part.check("dp x tp against dp", worst <= LAYOUT_RTOL[dtype],
                       f"losses within {worst:.1e} of the FSDP2 run's (bound {LAYOUT_RTOL[dtype]:g}, {dtype})")

    def plan_allreduce(self) -> Plan:
        if self.devices < 2:
            return [("all-reduce", "one GPU: no all-reduce across GPUs")]
        return [(f"all-reduce over {self.devices}", self.allreduce)]

    def allreduce(self, part: Part) -> None:
        sizes = ["1", "64", "1024"] if self.device == "cuda" else ["1", "8"]
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.devices}",
                "-m", "trainer.gpucheck", "allreduce", "--sizes", *sizes,
                "--iters", "10" if self.device == "cuda" else "3"]
        if result := self.run_json(part, f"all-reduce over {self.devices}", argv, env={"OMP_NUM_THREADS": "1"}):
            part.results["allreduce"] = result
            best = max(result["sizes"], key=lambda r: r["bus_gbs"])
            part.check("all-reduce sums", not any(r["wrong"] for r in result["sizes"]),
                       f"{result['backend']} over {result['world']}: {best['bus_gbs']:.1f} GB/s bus bandwidth at "
                       f"{best['mib']:g} MiB")

    def plan_speed(self) -> Plan:
        return [(f"{case}, {mode}", "on the CPU only eager runs: train.compile compiles on CUDA"
                 if mode == "compiled" and self.device == "cpu"
                 else lambda part, c=case, m=mode: self.speed_case(part, c, m == "compiled"))
                for mode in ("eager", "compiled") for case in ("ours", "bare")]

    def speed_case(self, part: Part, case: str, compiled: bool) -> None:
        what = f"{case}, {'compiled' if compiled else 'eager'}"
        if self.device == "cuda":  # the tiny preset at seq 512 in bf16: bench/trainer.py's first setting
            args = ["--preset", "tiny", "--seq-len", "512", "--micro-batch", "16", "--steps", "40", "--warmup", "10",
                    "--log-interval", "10", "--dtype", "bfloat16"]
        else:
            args = ["--preset", "custom", "--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                    "--vocab", "4096", "--seq-len", "128", "--micro-batch", "4", "--steps", "8", "--warmup", "2",
                    "--log-interval", "2", "--dtype", "float32"]
        run_dir = self.work / "speed" / what.replace(", ", "-")
        argv = [sys.executable, "-m", "trainer.speed", case, "--device", self.device, *args, "--data", "builtin",
                "--cache-dir", str(self.work / "tokens"), *(["--run-dir", str(run_dir)] if case == "ours" else []),
                *(["--compile"] if compiled else [])]
        result = self.run_json(part, what, argv, env={"OMP_NUM_THREADS": "1"} if self.device == "cpu" else {})
        if result is None:
            return
        rows = part.results.setdefault("rows", [])
        rows.append({"case": what, **result})
        for row in rows:  # against the bare loop of the same mode
            mode = row["case"].split(", ")[1]
            base = next((r for r in rows if r["case"] == f"bare, {mode}"), None)
            row["vs_bare"] = row["tokens_per_s_per_device"] / base["tokens_per_s_per_device"] if base else None
        part.check(f"{what} trains", result["tokens_per_s"] > 0, f"{result['tokens_per_s']:,.0f} tokens/s")


def _trained(part: Part, what: str, rc: int, output: str, losses: dict[int, float], steps: range, detail: str) -> bool:
    """A check that a run ended well with the losses of `steps` logged; its output's last line where not."""
    return part.check(what, rc == 0 and sorted(losses) == list(steps),
                      detail if rc == 0 and losses else f"exit {rc}: {failure_line(output)}")


def _worst(got: dict[int, float], ref: dict[int, float]) -> float:
    """The largest relative difference of `got`'s losses from `ref`'s (inf where a step is missing)."""
    return max((abs(v - ref[s]) / abs(ref[s]) if ref.get(s) else float("inf") for s, v in got.items()),
               default=float("inf"))


def _attempts(run_dir: Path) -> list[dict[int, float]]:
    """The train losses of each attempt of a run, in order (metrics.jsonl marks each start)."""
    attempts: list[dict[int, float]] = []
    with contextlib.suppress(ConfigError):
        for record in read_metrics(run_dir):
            if record.get("kind") == "restart" or not attempts:
                attempts.append({})
            if record.get("kind") == "train":
                attempts[-1][record["step"]] = record["loss"]
    return [a for a in attempts if a]
