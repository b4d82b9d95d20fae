"""report.md of `slipway gpu-check`, rendered from report.json's tree (jobs/gpucheck.py), the one
place that text is written. Values from the node (GPU names, versions, errors) are escaped for
Markdown tables."""

from __future__ import annotations

from typing import Any, Optional

# The issue-40 targets on one H100, for the tiny preset at seq 512 in bf16.
TARGET_MFU, TARGET_VS_TITAN = 0.40, 1.1


def render_markdown(report: dict[str, Any]) -> str:
    parts = {p["name"]: p for p in report["parts"]}
    checks = [c for p in report["parts"] for c in p["checks"]]
    skipped = [s for p in report["parts"] for s in p["skipped"]]
    node = parts.get("node", {}).get("results", {})
    lines = [f"# slipway gpu-check: {_cell(node.get('host', '?'))}, {report['started']}", "",
             f"**{report['verdict']}**: {sum(c['ok'] for c in checks)} of {len(checks)} checks passed, "
             f"{len(skipped)} skipped; {report['device']} ({_devices(report)}), {report['seconds']:.0f} s of "
             f"{sum(report['budgets'].values()):.0f} s.", "",
             "| part | status | seconds | budget s |", "|---|---|---:|---:|"]
    lines += [f"| {p['name']} | {p['status']} | {p['seconds']:.1f} | {p['budget_s']:g} |" for p in report["parts"]]
    for part in report["parts"]:
        lines += ["", f"## {part['name']}", ""]
        lines += SECTIONS.get(part["name"], lambda p, r: [])(part["results"], report)
        lines += [""] + [f"- {'ok' if c['ok'] else '**FAILED**'}: {c['what']}: {_text(c['detail'])}"
                         for c in part["checks"]]
        lines += [f"- skipped: {s['what']}: {_text(s['why'])}" for s in part["skipped"]]
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def _devices(report: dict) -> str:
    return f"{report['devices']} GPU(s)" if report["device"] == "cuda" else \
        f"{report['devices']} processes standing for GPUs"


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _text(value: Any) -> str:
    return " ".join(str(value).split())


def _num(value: Optional[float], spec: str) -> str:
    return "" if value is None else format(value, spec)


def _node(r: dict, report: dict) -> list[str]:
    if not r:
        return []
    lines = []
    if r.get("gpus"):
        lines += ["| GPU | name | compute capability | memory GiB | SMs | PCI | NUMA node |", "|---|---|---|---:|---:|---|---|"]
        lines += [f"| {g['index']} | {_cell(g['name'])} | {g['capability']} | {g['memory_gib']} | {g['sms']} | "
                  f"{g['pci']} | {g['numa_node']} |" for g in r["gpus"]]
        lines.append("")
    facts = [("driver", r.get("driver") or "unknown (no nvidia-smi)"), ("CUDA (torch built for)", r.get("torch_cuda")),
             ("torch", r.get("torch")), ("torch's kernels", " ".join(r.get("torch_archs") or []) or None),
             ("NCCL", r.get("nccl")), ("flash-attn", r.get("flash_attn") or "not installed"),
             ("torchtitan", r.get("torchtitan") or "not installed"), ("Python", f"{r.get('python')} ({r.get('machine')})"),
             ("CPUs", f"{r.get('cpus')} (this process may use {r.get('affinity')})"),
             ("NUMA nodes", "; ".join(f"{n}: {c}" for n, c in (r.get("numa") or {}).items()) or None),
             ("numactl --show", r.get("numactl") or "numactl not installed")]
    lines += [f"- {name}: {_text(value)}" for name, value in facts if value is not None]
    env = r.get("environment") or {}
    if env:
        lines += ["", "The environment slipway exports for the ranks (slipway local; the batch script the same, "
                      "with the node preset's network settings):", ""]
        lines += [f"- `{k}={_text(v)}`" for k, v in env.items()]
    return lines


def _correctness(r: dict, report: dict) -> list[str]:
    lines = []
    series = {k: v for k, v in r.items() if isinstance(v, dict) and k != "attention" and v}
    if series:
        names = list(series)
        lines += ["| step | " + " | ".join(names) + " | relative difference |", "|---:|" + "---:|" * (len(names) + 1)]
        ref, got = series[names[0]], series[names[-1]]
        for step in sorted({int(s) for v in series.values() for s in v}):
            values = [v.get(step, v.get(str(step))) for v in series.values()]
            a, b = ref.get(step, ref.get(str(step))), got.get(step, got.get(str(step)))
            diff = abs(b - a) / abs(a) if a and b is not None and len(names) > 1 else None
            lines.append(f"| {step} | " + " | ".join(_num(v, ".5f") for v in values) + f" | {_num(diff, '.1e')} |")
    attention = r.get("attention")
    if attention:
        lines += ["", f"Attention, {attention['dtype']} against the math path in fp32 on {attention['device']}, "
                      f"shape {attention['shape']} (largest absolute error, bound):", "",
                  "| kernel | output | dq | dk | dv |", "|---|---|---|---|---|"]
        for name, k in attention["kernels"].items():
            cells = [f"{k['errors'][w]['error']:.3g} ({k['errors'][w]['bound']:.3g})" for w in ("output", "dq", "dk", "dv")] \
                if "errors" in k else [_cell(k.get("error", "")), "", "", ""]
            lines.append(f"| {_cell(name)} | " + " | ".join(cells) + " |")
    return lines


def _training(r: dict, report: dict) -> list[str]:
    series = {k: v for k, v in (r.get("losses") or {}).items() if v}
    if not series:
        return []
    lines = ["| step | " + " | ".join(series) + " |", "|---:|" + "---:|" * len(series)]
    for step in sorted({int(s) for v in series.values() for s in v}):
        lines.append(f"| {step} | " + " | ".join(_num(v.get(step, v.get(str(step))), ".6f") for v in series.values())
                     + " |")
    return lines


def _allreduce(r: dict, report: dict) -> list[str]:
    result = r.get("allreduce")
    if not result:
        return []
    return ([f"{result['backend']}, {result['world']} ranks:", "", "| MiB | ms each | bus bandwidth GB/s |",
             "|---:|---:|---:|"] +
            [f"| {row['mib']:g} | {row['ms']:.2f} | {row['bus_gbs']:.2f} |" for row in result["sizes"]])


def _speed(r: dict, report: dict) -> list[str]:
    rows = r.get("rows") or []
    if not rows:
        return []
    first = rows[0]
    lines = [f"{first['device_name']}, torch {first['torch']}; {first['flops_per_token'] / 1e6:.0f} MFLOP a token "
             "(torchtitan's 6N + 12LHQT); SDPA's flash backend in every case on CUDA.", "",
             "| case | tokens/s | tokens/s a device | TFLOP/s a device | MFU % | peak GiB (reserved) | vs bare | "
             "vs torchtitan |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        mfu = row.get("mfu")
        lines.append(f"| {row['case']} | {row['tokens_per_s']:,.0f} | {row['tokens_per_s_per_device']:,.0f} | "
                     f"{row['tflops_per_device']:.3f} | {_num(mfu and 100 * mfu, '.1f')} | "
                     f"{_num(row.get('peak_memory_gib'), '.2f')}{_reserved(row)} | "
                     f"{_num(row.get('vs_bare'), '.3f')} | {_num(row.get('vs_torchtitan'), '.3f')} |")
    if report["device"] == "cuda":
        lines += ["", f"Targets (one H100, issue 40): MFU >= {TARGET_MFU:.0%}, ours >= {TARGET_VS_TITAN}x torchtitan:"]
        for row in rows:
            if row["case"].startswith("ours"):
                mfu, titan = row.get("mfu"), row.get("vs_torchtitan")
                lines.append(f"- {row['case']}: MFU {_num(mfu and 100 * mfu, '.1f') or 'unknown'}% "
                             f"({'met' if mfu and mfu >= TARGET_MFU else 'not met'}), vs torchtitan "
                             f"{_num(titan, '.2f') or 'not run'} ({'met' if titan and titan >= TARGET_VS_TITAN else 'not met'})")
    return lines


def _reserved(row: dict) -> str:
    return "" if row.get("peak_reserved_gib") is None else f" ({row['peak_reserved_gib']:.2f})"


SECTIONS = {"node": _node, "correctness": _correctness, "training": _training, "allreduce": _allreduce,
            "speed": _speed}
