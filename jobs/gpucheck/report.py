"""report.md of `slipway gpu-check`, rendered from report.json's tree (jobs/gpucheck/check.py), the one
place that text is written. Values from the node (GPU names, versions, errors) are escaped for
Markdown tables."""

from __future__ import annotations

from typing import Any, Optional

# The target on one H100, for the tiny preset at seq 512 in bf16.
TARGET_MFU = 0.40


def render_markdown(report: dict[str, Any]) -> str:
    checks = [c for p in report["parts"] for c in p["checks"]]
    skipped = [s for p in report["parts"] for s in p["skipped"]]
    node = report["parts"][0]["results"] if report["parts"] and report["parts"][0]["name"] == "node" else {}
    devices = f"{report['devices']} GPU(s)" if report["device"] == "cuda" else \
        f"{report['devices']} processes standing for GPUs"
    lines = [f"# slipway gpu-check: {_cell(node.get('host', '?'))}, {report['started']}", "",
             f"**{report['verdict']}**: {sum(c['ok'] for c in checks)} of {len(checks)} checks passed, "
             f"{len(skipped)} skipped; {report['device']} ({devices}), {report['seconds']:.0f} s of "
             f"{sum(report['budgets'].values()):.0f} s.", ""]
    lines += _table(["part", "status", "seconds", "budget s"], "llrr",
                    [[p["name"], p["status"], f"{p['seconds']:.1f}", f"{p['budget_s']:g}"] for p in report["parts"]])
    for part in report["parts"]:
        lines += ["", f"## {part['name']}", ""]
        lines += SECTIONS[part["name"]](part["results"], report) if part["results"] else []
        lines += [""] + [f"- {'ok' if c['ok'] else '**FAILED**'}: {c['what']}: {_text(c['detail'])}"
                         for c in part["checks"]]
        lines += [f"- skipped: {s['what']}: {_text(s['why'])}" for s in part["skipped"]]
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def _table(header: list[str], align: str, rows: list[list[Any]]) -> list[str]:
    """A Markdown table; `align` a letter a column: l (left) or r (right)."""
    return (["| " + " | ".join(header) + " |", "|" + "".join("---:|" if a == "r" else "---|" for a in align)]
            + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _text(value: Any) -> str:
    return " ".join(str(value).split())


def _num(value: Optional[float], spec: str) -> str:
    return "" if value is None else format(value, spec)


def _series(series: dict[str, dict], spec: str, diff: bool = False) -> list[str]:
    """Loss series side by side, a row a step; `diff`: the relative difference of the last from the first."""
    names = list(series)
    header = ["step", *names, *(["relative difference"] if diff else [])]
    rows = []
    for step in sorted({s for v in series.values() for s in v}):  # int steps: rendered before JSON holds them
        a, b = series[names[0]].get(step), series[names[-1]].get(step)
        rows.append([step, *(_num(v.get(step), spec) for v in series.values()),
                     *([_num(abs(b - a) / abs(a) if a and b is not None and len(names) > 1 else None, ".1e")]
                       if diff else [])])
    return _table(header, "r" * len(header), rows)


def _node(r: dict, report: dict) -> list[str]:
    lines = []
    if r.get("gpus"):
        lines += _table(["GPU", "name", "compute capability", "memory GiB", "SMs", "PCI", "NUMA node"], "lllrrll",
                        [[g["index"], _cell(g["name"]), g["capability"], g["memory_gib"], g["sms"], g["pci"],
                          g["numa_node"]] for g in r["gpus"]]) + [""]
    facts = [("driver", r.get("driver") or "unknown (no nvidia-smi)"), ("CUDA (torch built for)", r.get("torch_cuda")),
             ("torch", r.get("torch")), ("torch's kernels", " ".join(r.get("torch_archs") or []) or None),
             ("NCCL", r.get("nccl")), ("flash-attn", r.get("flash_attn") or "not installed"),
             ("Python", f"{r.get('python')} ({r.get('machine')})"),
             ("CPUs", f"{r.get('cpus')} (this process may use {r.get('affinity')})"),
             ("NUMA nodes", "; ".join(f"{n}: {c}" for n, c in (r.get("numa") or {}).items()) or None),
             ("numactl --show", r.get("numactl") or "numactl not installed")]
    lines += [f"- {name}: {_text(value)}" for name, value in facts if value is not None]
    if r.get("environment"):
        lines += ["", "The environment slipway exports for the ranks (slipway local; the batch script the same, "
                      "with the node preset's network settings):", ""]
        lines += [f"- `{k}={_text(v)}`" for k, v in r["environment"].items()]
    return lines


def _correctness(r: dict, report: dict) -> list[str]:
    series = {k: v for k, v in r.items() if isinstance(v, dict) and k != "attention" and v}
    lines = _series(series, ".5f", diff=True) if series else []
    if attention := r.get("attention"):
        lines += ["", f"Attention, {attention['dtype']} against the math path in fp32 on {attention['device']}, "
                      f"shape {attention['shape']} (largest absolute error, bound):", ""]
        lines += _table(["kernel", "output", "dq", "dk", "dv"], "lllll", [
            [_cell(name), *([f"{k['errors'][w]['error']:.3g} ({k['errors'][w]['bound']:.3g})"
                             for w in ("output", "dq", "dk", "dv")] if "errors" in k
                            else [_cell(k.get("error", "")), "", "", ""])]
            for name, k in attention["kernels"].items()])
    return lines


def _training(r: dict, report: dict) -> list[str]:
    series = {k: v for k, v in (r.get("losses") or {}).items() if v}
    return _series(series, ".6f") if series else []


def _allreduce(r: dict, report: dict) -> list[str]:
    result = r.get("allreduce")
    if not result:
        return []
    return [f"{result['backend']}, {result['world']} ranks:", ""] + _table(
        ["MiB", "ms each", "bus bandwidth GB/s"], "rrr",
        [[f"{row['mib']:g}", f"{row['ms']:.2f}", f"{row['bus_gbs']:.2f}"] for row in result["sizes"]])


def _speed(r: dict, report: dict) -> list[str]:
    rows = r.get("rows") or []
    if not rows:
        return []
    first = rows[0]
    lines = [f"{first['device_name']}, torch {first['torch']}; {first['flops_per_token'] / 1e6:.0f} MFLOP a token "
             "(torchtitan's 6N + 12LHQT); SDPA's flash backend in every case on CUDA.", ""]
    reserved = [f" ({row['peak_reserved_gib']:.2f})" if row.get("peak_reserved_gib") is not None else ""
                for row in rows]
    lines += _table(["case", "tokens/s", "tokens/s a device", "TFLOP/s a device", "MFU %", "peak GiB (reserved)",
                     "vs bare"], "lrrrrrr", [
        [row["case"], f"{row['tokens_per_s']:,.0f}", f"{row['tokens_per_s_per_device']:,.0f}",
         f"{row['tflops_per_device']:.3f}", _num(row.get("mfu") and 100 * row["mfu"], ".1f"),
         _num(row.get("peak_memory_gib"), ".2f") + extra, _num(row.get("vs_bare"), ".3f")]
        for row, extra in zip(rows, reserved)])
    if report["device"] == "cuda":
        bare = {row["case"].removeprefix("bare"): row.get("mfu") for row in rows if row["case"].startswith("bare")}
        lines += ["", f"The target on one H100: MFU >= {TARGET_MFU:.0%}:"]
        for row in rows:
            variant = row["case"].removeprefix("ours")
            if variant == row["case"]:
                continue
            said = "met" if (row.get("mfu") or 0) >= TARGET_MFU else "not met"
            if said == "not met" and variant in bare:  # a model too small for the GPU misses by the bare loop too
                said += f"; the bare loop: {_percent(bare[variant])}"
            lines.append(f"- {row['case']}: MFU {_percent(row.get('mfu'))} ({said})")
    return lines


def _percent(fraction: Optional[float]) -> str:
    return f"{_num(fraction and 100 * fraction, '.1f') or 'unknown'}%"


SECTIONS = {"node": _node, "correctness": _correctness, "training": _training, "allreduce": _allreduce,
            "speed": _speed}
