"""Training throughput: our trainer against a bare PyTorch loop and torchtitan.

One run prints, side by side, steady-state tokens/s, model TFLOP/s, MFU (null
on CPU or an unknown GPU) and peak memory for the cases of trainer/speed.py
(`python -m trainer.speed CASE`, which `slipway gpu-check` measures with too):

  ours          `trainer.train.train` in one process (what `python -m trainer` runs),
                with its defaults: losses kept on the device between logged steps,
                batches read ahead, device-side non-finite skip, gc every 50 steps
  ours fsdp x2  the same under `torchrun --nproc-per-node 2`, dp=2 (FSDP2); opt-in
  bare          a plain loop on the same `trainer.model.Transformer`: same batch,
                fused AdamW, grad clipping, same dtype, compile and activation
                checkpointing; one host sync at the end of the timed steps
  torchtitan    torchtitan 0.3.0 on our torch (this environment, or .cache/bench-venv
                made over it), its llama3 trainer with the same model (dimensions,
                padded vocabulary, unfused q/k/v), batch, sequence length, dtype,
                compile and activation checkpointing, logging as often as ours;
                its logged tps parsed. Its SDPA row (the flash backend on CUDA, as
                ours) is the one compared; its flex attention is a separate row
                (--titan-flex, always with --matrix). It needs CUDA (it picks
                device cuda even without one), so on CPU it runs only with
                --torchtitan; --check-torchtitan checks its model on the CPU.

The overhead ratio is ours / bare tokens/s (1.00 = no overhead). FLOPs per
token follow torchtitan's convention (`trainer.model.num_flops_per_token`, the
padded vocabulary included) for every case. Every case runs in a fresh process
(peak memory is per case); the first `--warmup` steps are left out, and so is
each trainer's first logged window. The model is untied in every case
(torchtitan's llama3 has no tied embeddings). Ours reads the shipped corpus and
tokenizer where torchtitan runs (CUDA; what torchtitan reads), random tokens on
CPU (`--data`); the bare loop always random tokens. `make gpu-report`
(`--gpu-report`) runs the GPU tests and the matrix and writes them up.

    .venv/bin/python bench/trainer.py                       # CPU: a small model, ours vs bare
    .venv/bin/python bench/trainer.py --device cuda         # tiny (109M) at seq 512, bf16, eager
    .venv/bin/python bench/trainer.py --matrix              # CUDA: the issue-10 comparison, see below
    .venv/bin/python bench/trainer.py --compile --ac selective --no-torchtitan

`--matrix` (CUDA) runs the tiny preset at seq 512 (micro batch 16) and the ~1.1B
`base` preset at seq 2048 (micro batch 4), each eager and compiled, each without
and with selective (per-op) activation checkpointing: ours, torchtitan and bare
for every one of the 8 settings, in one table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.errors import failure_line  # noqa: E402
from trainer import speed  # noqa: E402  (the cases: what `slipway gpu-check` measures with)
import titan  # noqa: E402  (bench/titan.py: torchtitan's case)

BENCH_VENV = ROOT / ".cache" / "bench-venv"
TORCHTITAN_VERSION = "0.3.0"

# Case defaults per device (a preset name or explicit dimensions). Both trainers log (and so
# wait for the device) every log_interval steps; the timed windows start after `warmup`.
CPU_DEFAULTS = dict(preset="custom", hidden=256, layers=4, heads=4, kv_heads=4, vocab=4096, ffn=None,
                    seq_len=256, micro_batch=8, steps=24, warmup=4, log_interval=4, dtype="float32")
CUDA_DEFAULTS = dict(preset="tiny", seq_len=512, micro_batch=16, steps=60, warmup=10, log_interval=10,
                     dtype="bfloat16")
# --matrix: (label, preset, seq_len, micro batch, steps) x (compile, activation checkpointing).
MATRIX_MODELS = (("tiny 109M", "tiny", 512, 16, 60), ("base 1.1B", "base", 2048, 4, 40))
MATRIX_VARIANTS = ((False, "none"), (True, "none"), (False, "selective"), (True, "selective"))


# --------------------------------------------------------------------------
# Ours and bare live in the product (trainer/speed.py: `slipway gpu-check` measures with them on a
# user's node), torchtitan's in bench/titan.py; here they run, each in a process of its own, and are compared.
# --------------------------------------------------------------------------


def titan_python(args: argparse.Namespace) -> tuple[Optional[Path], str]:
    """A python with torchtitan importable on the very torch ours runs on, or None and why not:
    this one if it has torchtitan, else the bench venv, made on top of this environment
    (--system-site-packages: its torch, the image's on a GPU machine; only torchtitan and what
    it needs besides torch go into the venv)."""
    import torch

    check = "import torchtitan, torch; print(torch.__version__)"
    here = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    if here.returncode == 0:
        return Path(sys.executable), ""
    python = BENCH_VENV / "bin" / "python"
    got = subprocess.run([str(python), "-c", check], capture_output=True, text=True) if python.exists() else None
    if got is not None and got.returncode == 0 and got.stdout.strip() == torch.__version__:
        return python, ""
    if args.no_install:
        return None, f"not installed in {BENCH_VENV.relative_to(ROOT)} (--no-install)"
    print(f"installing torchtitan {TORCHTITAN_VERSION} into {BENCH_VENV.relative_to(ROOT)} over this torch "
          f"{torch.__version__} ...", file=sys.stderr)
    shutil.rmtree(BENCH_VENV, ignore_errors=True)  # a venv of another torch (the bench once pinned its own)
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(BENCH_VENV)],
             # torchtitan imports triton unconditionally; CPU torch wheels do not pull it in
             [str(python), "-m", "pip", "install", "-q", f"torchtitan=={TORCHTITAN_VERSION}", "triton",
              f"torch=={torch.__version__}"]]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode != 0:
            return None, f"install failed: {failure_line(proc.stdout + proc.stderr)}"
    got = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
    if got.stdout.strip() != torch.__version__:
        return None, f"the bench venv's torch is {got.stdout.strip() or 'missing'}, not ours ({torch.__version__})"
    return python, ""


def check_torchtitan_model(args: argparse.Namespace) -> tuple[Optional[int], str]:
    """The CPU check: torchtitan's config module loads and builds (on the meta device) the model
    ours trains: (its parameter count or None, the output)."""
    python, why = titan_python(args)
    if python is None:
        return None, why
    work = Path(tempfile.mkdtemp(prefix="slipway-titan-check-"))
    try:  # the config module as the comparison writes it; its model built on the meta device and counted
        (work / "slipway_titan.py").write_text(titan.TITAN_MODULE.format(params=titan.titan_params(args, "sdpa", work)))
        count = ("import torch, slipway_titan\nmodel = slipway_titan.slipway_llama().model_spec.model\n"
                 "with torch.device('meta'):\n    built = model.build()\n"
                 "print('TITAN_PARAMS', sum(p.numel() for p in built.parameters()))")
        proc = subprocess.run([str(python), "-c", count], cwd=work, env=titan.titan_env(work), capture_output=True,
                              text=True, timeout=args.timeout)
        m = re.search(r"^TITAN_PARAMS (\d+)$", proc.stdout, re.M)
        return (int(m[1]) if m else None), proc.stdout + proc.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_torchtitan(args: argparse.Namespace, attention: str = "sdpa") -> tuple[Optional[dict], str]:
    python, why = titan_python(args)
    if python is None:
        return None, why
    return run_subprocess([str(python), str(Path(titan.__file__)), *case_argv(args, "torchtitan")[2:],
                           "--attention-titan", attention], args.timeout)


# --------------------------------------------------------------------------
# The driver: start each case, collect, print.
# --------------------------------------------------------------------------


def case_argv(case: argparse.Namespace, name: str) -> list[str]:
    """`-m trainer.speed NAME ...` for `case` (bench's arguments: trainer/speed.py's flags as attributes)."""
    argv = ["-m", "trainer.speed", name, "--device", case.device, "--preset", case.preset, "--seq-len",
            str(case.seq_len), "--micro-batch", str(case.micro_batch), "--steps", str(case.steps), "--warmup",
            str(case.warmup), "--log-interval", str(case.log_interval), "--dtype", case.dtype, "--data", case.data,
            "--ac", case.ac, "--attention", case.attention]
    for flag in ("hidden", "layers", "heads", "kv_heads", "vocab", "ffn", "hang_timeout", "cache_dir", "run_dir"):
        if getattr(case, flag, None) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(case, flag))]
    return argv + (["--compile"] if case.compile else [])


def run_subprocess(argv: list[str], timeout: float, env: Optional[dict] = None) -> tuple[Optional[dict], str]:
    """(the RESULT json or None, the output's tail)."""
    try:
        proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, f"timed out after {timeout:.0f}s\n{out[-2000:]}"
    output = proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):]), output
    return None, f"exit {proc.returncode}\n{output[-3000:]}"


def run_ours_fsdp2(args: argparse.Namespace) -> tuple[Optional[dict], str]:
    run_dir = Path(tempfile.mkdtemp(prefix="slipway-bench-fsdp-"))
    try:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                *case_argv(args, "ours"), "--run-dir", str(run_dir)]
        return run_subprocess(argv, args.timeout)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda if available, else cpu")
    parser.add_argument("--preset", default=None, help="tiny|small|base|large (trainer.config.MODEL_PRESETS) "
                        "or custom; CPU default: custom 256x4")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--ffn", type=int, help="intermediate size (default: the preset's, or 2 x hidden)")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--micro-batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup", type=int, help="leading steps left out of the figures")
    parser.add_argument("--log-interval", type=int, help="steps between logged (host-synced) steps, ours and "
                        "torchtitan's; CPU default 4, CUDA 10")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="CPU default float32, CUDA bfloat16")
    parser.add_argument("--data", choices=("synthetic", "builtin"), default=None,
                        help="ours: random tokens, or the shipped corpus and tokenizer (what torchtitan reads: "
                             "the default where torchtitan runs, CUDA; synthetic on CPU); bare: always random")
    parser.add_argument("--attention", choices=("sdpa", "flash", "auto"), default="sdpa",
                        help="ours and bare: model.attention; sdpa (default) is torchtitan's SDPA row's kernel "
                             "(SDPA's flash backend on CUDA)")
    parser.add_argument("--titan-flex", action="store_true",
                        help="also torchtitan with its own flex attention, a separate row (--matrix: always)")
    parser.add_argument("--gpu-report", action="store_true",
                        help="only this (CUDA): the GPU tests and --matrix, written as a BENCHMARKS.md section with "
                             "the device and the date to --report (`make gpu-report`)")
    parser.add_argument("--report", type=Path, default=None,
                        help="where --gpu-report writes (default gpu-report-DATE.md here)")
    parser.add_argument("--check-torchtitan", action="store_true",
                        help="only this (CPU is enough): torchtitan's config module loads and builds the same model "
                             "(parameter count) as ours")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (every case)")
    parser.add_argument("--ac", choices=("none", "selective", "full"), default="none",
                        help="activation checkpointing (every case; selective = per op)")
    parser.add_argument("--matrix", action="store_true", help="CUDA: tiny at seq 512 and base (1.1B) at seq 2048, "
                        "each eager/compiled x no/selective activation checkpointing, ours, bare and torchtitan")
    parser.add_argument("--fsdp2", action="store_true", help="also run ours on 2 processes, dp=2 (FSDP2)")
    parser.add_argument("--no-torchtitan", action="store_true", help="skip torchtitan")
    parser.add_argument("--torchtitan", action="store_true", help="try torchtitan on CPU too (it needs CUDA)")
    parser.add_argument("--no-install", action="store_true",
                        help="use .cache/bench-venv only if it exists; never pip install")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every case (CPU: torchrun's default "
                        "is 1 per process; a busy machine gives steadier figures at 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--watchdog-cost", type=int, default=0, metavar="N",
                        help="only this: ours N times with the hang watchdog on and N times off, alternating; "
                             "the ratio of their tokens/s")
    parser.add_argument("--hang-timeout", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.device is None:
        try:
            import torch
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    if args.gpu_report:
        import datetime
        if args.device != "cuda":
            parser.error("--gpu-report measures on a GPU: no CUDA device here; run it on a GPU machine (make gpu-report)")
        args.matrix = True
        args.report = args.report or Path(f"gpu-report-{datetime.date.today().isoformat()}.md")
    if args.matrix and args.device != "cuda":
        parser.error("--matrix compares GPU runs (compile, bf16, torchtitan): it needs --device cuda")
    if args.matrix:
        args.titan_flex = True
    apply_defaults(args)
    if args.data is None:
        args.data = "builtin" if args.device == "cuda" and not args.no_torchtitan else "synthetic"
    args.cache_dir = str(ROOT / ".cache" / "bench-data")  # the shipped tokenizer's cache lives with the bench
    if args.check_torchtitan:
        return drive_check_torchtitan(args)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every case's process
    if args.watchdog_cost:
        return drive_watchdog_cost(args)
    if args.gpu_report:
        return drive_gpu_report(args)
    if args.matrix:
        return drive_matrix(args)
    return drive(args)


def drive_check_torchtitan(args: argparse.Namespace) -> int:
    """torchtitan's config module, as the comparison writes it, builds the model ours trains: the same
    parameter count (the same dimensions, untied, padded vocabulary, unfused q/k/v)."""
    sys.path.insert(0, str(ROOT))
    from common.schema import from_dict
    from trainer.config import ModelSection

    ours = from_dict(ModelSection, speed.model_dict(args)).num_params()
    titan, output = check_torchtitan_model(args)
    if titan is None:
        print(f"torchtitan check FAILED: {titan.titan_error(output) if chr(10) in output else output}", file=sys.stderr)
        return 1
    same = titan == ours
    print(f"torchtitan {TORCHTITAN_VERSION} config module loads; parameters: ours {ours:,}, torchtitan {titan:,}"
          f" ({'the same' if same else 'DIFFERENT'})")
    return 0 if same else 1


def drive_watchdog_cost(args: argparse.Namespace) -> int:
    """--watchdog-cost N: ours N times with the hang watchdog on (the default train.hang_timeout: its
    thread, the step marks, rank 0's progress.json) and N times off (train.hang_timeout 0),
    alternating so that the machine's drift falls on both; the ratio of the medians, 1.00 for none."""
    import statistics

    sys.path.insert(0, str(ROOT))
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(args.watchdog_cost):
        for label, extra in (("on", []), ("off", ["--hang-timeout", "0"])):
            result, output = run_subprocess([sys.executable, *case_argv(args, "ours"), *extra], args.timeout)
            if result is None:
                print(f"ours, watchdog {label}: not run: {failure_line(output)}", file=sys.stderr)
                return 1
            rates[label].append(result["tokens_per_s"])
            print(f"  ours, watchdog {label} (run {i + 1}): {result['tokens_per_s']:,.0f} tok/s", file=sys.stderr,
                  flush=True)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    pairs = ", ".join(f"{a / b:.3f}" for a, b in zip(rates["on"], rates["off"]))
    print(f"hang watchdog cost: on / off = {on / off:.3f} (medians of {args.watchdog_cost} runs each: {on:,.0f} vs "
          f"{off:,.0f} tokens/s; run by run {pairs})")
    if args.json:
        args.json.write_text(json.dumps({"watchdog_on": rates["on"], "watchdog_off": rates["off"],
                                         "ratio_of_medians": on / off}, indent=1))
    return 0


def apply_defaults(args: argparse.Namespace) -> None:
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    if args.preset is not None and args.preset != "custom" and args.device == "cpu":
        defaults = {**defaults, "hidden": None, "layers": None, "heads": None, "kv_heads": None, "vocab": None}
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def fmt(value: Any, spec: str) -> str:
    return "null" if value is None else format(value, spec)


def describe(args: argparse.Namespace, flops_per_token: int) -> str:
    import torch

    from common.schema import from_dict
    from trainer.config import ModelSection

    mcfg = from_dict(ModelSection, speed.model_dict(args))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    return (f"model: hidden {mcfg.hidden_size}, ffn {mcfg.intermediate_size}, {mcfg.num_layers} layers, "
            f"{mcfg.num_heads} heads ({mcfg.num_kv_heads} kv), vocab {mcfg.vocab_size} (padded {mcfg.padded_vocab_size} "
            f"in ours), untied, {mcfg.num_params() / 1e6:.1f}M params; micro batch {args.micro_batch} x seq "
            f"{args.seq_len}, {args.dtype}, {args.steps} steps ({args.warmup} warmup left out, logged every "
            f"{args.log_interval}), data {args.data}; {device_name}, OMP_NUM_THREADS "
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; torch {torch.__version__}; "
            f"{flops_per_token / 1e6:.1f} MFLOP/token")


def run_cases(args: argparse.Namespace) -> list[tuple[str, Optional[dict], str]]:
    """ours, (ours x2), bare, torchtitan for one setting; each (name, result or None, output or reason)."""
    cases: list[tuple[str, Optional[dict], str]] = []

    def add(name: str, result: Optional[dict], output: str) -> None:
        cases.append((name, result, output))
        setting = f"compile {'on' if args.compile else 'off'}, ac {args.ac}"
        if result is None:
            reason = failure_line(output) if "\n" in output else output
            reason = reason if reason.startswith("not run") else f"not run: {reason}"
            print(f"  {name} ({setting}): {reason}", file=sys.stderr, flush=True)
        else:
            print(f"  {name} ({setting}): {result['tokens_per_s']:,.0f} tok/s", file=sys.stderr, flush=True)

    add("ours (1 process)", *run_subprocess([sys.executable, *case_argv(args, "ours")], args.timeout))
    if args.fsdp2:
        add("ours (2 processes, fsdp dp=2)", *run_ours_fsdp2(args))
    add("bare PyTorch loop", *run_subprocess([sys.executable, *case_argv(args, "bare")], args.timeout))
    # Its SDPA row first: the one ours is compared with (the same kernel); flex, its default, apart.
    for attention in ("sdpa", "flex") if args.titan_flex else ("sdpa",):
        name = f"torchtitan {TORCHTITAN_VERSION} ({attention})"
        if args.no_torchtitan:
            add(name, None, "not run: --no-torchtitan")
        elif args.device == "cpu" and not args.torchtitan:
            add(name, None, f"not run: torchtitan {TORCHTITAN_VERSION} needs CUDA (it picks device cuda even without "
                            "one and fails in Trainer.__init__); --torchtitan tries anyway")
        else:
            add(name, *run_torchtitan(args, attention))
    return cases


def table_rows(cases: list[tuple[str, Optional[dict], str]], prefix: str = "") -> tuple[list[str], list[dict]]:
    """Printed rows and JSON records: each case against bare (ours/bare = the overhead) and
    against torchtitan (ours/torchtitan > 1: ours is faster)."""
    bare = next((r for n, r, _ in cases if n.startswith("bare")), None)
    titan = next((r for n, r, _ in cases if n.startswith("torchtitan")), None)
    lines, records = [], []
    for name, r, output in cases:
        if r is None:
            reason = output if "\n" not in output else failure_line(output)
            reason = reason if reason.startswith("not run") else f"not run: {reason}"
            lines.append(f"| {prefix}{name:<32} | {reason} |")
            records.append({"case": name, "not_run": reason})
            continue
        per_dev, tflops, mfu = r["tokens_per_s_per_device"], r["tflops_per_device"], r["mfu"]
        vs_bare = per_dev / bare["tokens_per_s"] if bare else None
        vs_titan = per_dev / titan["tokens_per_s_per_device"] if titan else None
        lines.append(f"| {prefix}{name:<32} | {r['tokens_per_s']:>10,.0f} | {per_dev:>10,.0f} | {tflops:>11.4f} | "
                     f"{fmt(mfu and 100 * mfu, '5.1f'):>6} | {fmt(r.get('peak_memory_gib'), '.2f'):>10} | "
                     f"{fmt(r.get('peak_reserved_gib'), '.2f'):>9} | {fmt(vs_bare, '.3f'):>7} | "
                     f"{fmt(vs_titan, '.3f'):>7} |")
        records.append({"case": name, **r, "vs_bare": vs_bare, "vs_torchtitan": vs_titan})
    return lines, records


HEADER = (f"| {'case':<32} | {'tokens/s':>10} | {'tok/s/dev':>10} | {'TFLOP/s/dev':>11} | {'MFU %':>6} | "
          f"{'alloc GiB':>10} | {'resv GiB':>9} | {'vs bare':>7} | {'vs titan':>7} |")
MEMORY_NOTE = ("peak memory: alloc = CUDA max allocated (ours, bare; on CPU the max RSS), resv = CUDA max reserved "
               "(all three: torchtitan logs only that).")


def print_header(prefix_width: int = 0, prefix: str = "") -> None:
    header = HEADER.replace("| ", f"| {prefix:<{prefix_width}}", 1) if prefix_width else HEADER
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")


def drive(args: argparse.Namespace) -> int:
    from common.schema import from_dict
    from trainer.config import ModelSection
    from common.layouts import num_flops_per_token

    flops_per_token = num_flops_per_token(from_dict(ModelSection, speed.model_dict(args)), args.seq_len)
    print(describe(args, flops_per_token) + f"; compile {'on' if args.compile else 'off'}, activation "
          f"checkpointing {args.ac}", flush=True)
    cases = run_cases(args)
    lines, records = table_rows(cases)
    print()
    print_header()
    print("\n".join(lines))
    ours, bare = cases[0][1], next(r for n, r, _ in cases if n.startswith("bare"))
    if ours and bare:
        print(f"\ntrainer overhead: ours / bare = {ours['tokens_per_s'] / bare['tokens_per_s']:.3f} "
              f"(step {1e3 * ours['step_time_s']:.1f} ms vs {1e3 * bare['step_time_s']:.1f} ms)")
    print(MEMORY_NOTE)
    if args.json:
        args.json.write_text(json.dumps({"flops_per_token": flops_per_token, "cases": records}, indent=1))
    return 0 if ours else 1


def drive_matrix(args: argparse.Namespace) -> int:
    """The GPU comparison of issue 10 in one table: MATRIX_MODELS x MATRIX_VARIANTS, ours,
    bare and torchtitan on each."""
    from common.schema import from_dict
    from trainer.config import ModelSection
    from common.layouts import num_flops_per_token

    all_lines, all_records, ok = [], [], True
    for label, preset, seq_len, micro_batch, steps in MATRIX_MODELS:
        for compiled, ac in MATRIX_VARIANTS:
            one = argparse.Namespace(**{**vars(args), "preset": preset, "seq_len": seq_len,
                                        "micro_batch": micro_batch, "steps": steps, "compile": compiled, "ac": ac,
                                        "hidden": None, "layers": None, "heads": None, "kv_heads": None,
                                        "vocab": None, "ffn": None})
            flops_per_token = num_flops_per_token(from_dict(ModelSection, speed.model_dict(one)), seq_len)
            print(f"[{label}] " + describe(one, flops_per_token) + f"; compile {'on' if compiled else 'off'}, "
                  f"activation checkpointing {ac}", flush=True)
            cases = run_cases(one)
            ok = ok and cases[0][1] is not None
            setting = f"{label}, {'compiled' if compiled else 'eager'}, ac {ac}: "
            lines, records = table_rows(cases, prefix=setting.ljust(36))
            all_lines += lines
            all_records += [{"model": label, "compile": compiled, "ac": ac, **r} for r in records]
    print()
    print_header(36, "model, mode, activation checkpointing: ")
    print("\n".join(all_lines))
    print(MEMORY_NOTE)
    if args.json:
        args.json.write_text(json.dumps({"cases": all_records}, indent=1))
    args.matrix_out = (all_lines, all_records)
    return 0 if ok else 1


# The issue-20 targets on one H100: ours / torchtitan (its SDPA row) tokens/s, and MFU.
TARGETS = {"tiny 109M": (1.1, 0.40), "base 1.1B": (1.0, 0.45)}


def drive_gpu_report(args: argparse.Namespace) -> int:
    """GPU readiness in one command (`make gpu-report`): the GPU tests, then the matrix against
    torchtitan, written with the device and the date as a BENCHMARKS.md section (args.report)."""
    import datetime
    import io
    import torch
    from contextlib import redirect_stdout

    if not torch.cuda.is_available():
        print("gpu-report: no CUDA device here: run it on a GPU machine (in the image: `make gpu-report`)",
              file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py"], cwd=ROOT,
                           capture_output=True, text=True)
    test_summary = (tests.stdout.strip().splitlines() or ["no output"])[-1]
    print(f"make test-gpu: {test_summary}", flush=True)
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        rc = drive_matrix(args)
    print(buffer.getvalue(), end="")
    lines, records = getattr(args, "matrix_out", ([], []))
    header = HEADER.replace("| ", f"| {'model, mode, activation checkpointing: ':<36}", 1)
    checks = []
    for model, (ratio, mfu) in TARGETS.items():
        for r in records:
            if r.get("model") == model and r["case"].startswith("ours") and "tokens_per_s" in r:
                got_ratio, got_mfu = r.get("vs_torchtitan"), r.get("mfu")
                mode = f"{'compiled' if r['compile'] else 'eager'}, ac {r['ac']}"
                ok = got_ratio is not None and got_ratio >= ratio and got_mfu is not None and got_mfu >= mfu
                checks.append(f"- {model}, {mode}: ours / torchtitan (sdpa) {fmt(got_ratio, '.2f')} (target >= "
                              f"{ratio}), MFU {fmt(got_mfu and 100 * got_mfu, '.1f')}% (target >= {100 * mfu:.0f}%): "
                              f"{'met' if ok else 'NOT met'}")
    text = "\n".join([
        f"## GPU: ours against torchtitan, {device} ({date})",
        f"`make gpu-report` on {device}, torch {torch.__version__} (ours and torchtitan in one environment).",
        f"`make test-gpu`: {test_summary} (exit {tests.returncode}).", "",
        header, "|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|", *lines, "",
        "Targets (issue 20):", *checks, "", MEMORY_NOTE, "",
        "Remaining differences: torchtitan tokenises the shipped corpus on the fly, ours reads it pre-tokenised "
        "(`--data builtin`), the bare loop random tokens; torchtitan builds its own Llama (RoPE as complex "
        "numbers, its init); its flex rows use its per-document block-causal masks, ours plain causal.", ""])
    args.report.write_text(text)
    print(f"\nwritten: {args.report} (paste it into BENCHMARKS.md)")
    return rc or tests.returncode


if __name__ == "__main__":
    sys.exit(main())
