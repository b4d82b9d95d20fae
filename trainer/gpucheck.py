"""What `slipway gpu-check` measures on the node itself, each as a process of its own (the host
command starts them, as the batch script starts the trainer, and reads one `RESULT {json}`
line); the trainer's runs and the throughput cases (trainer/speed.py) it starts as they are.

    python -m trainer.gpucheck node                    the node: GPUs, driver, CUDA, torch, NCCL,
                                                       flash-attn, NUMA layout
    python -m trainer.gpucheck attention --device D    SDPA's flash backend and flash-attn (where it
                                                       imports) against the math path, forward and backward
    torchrun --nproc-per-node N -m trainer.gpucheck allreduce --sizes 1 64 1024
                                                       all-reduce bus bandwidth across the node's GPUs
                                                       (the CPU's, gloo, where CUDA is hidden)
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from typing import Any, Optional

from common.edge import Parser
from trainer.preflight import time_all_reduce
from trainer.topology import cpu_ranges, gpu_numa_node, gpu_pci_addresses, numa_nodes, numactl_show, tool_output


def node() -> dict[str, Any]:
    """What the node is, as torch, nvidia-smi and sysfs say it."""
    import torch

    from trainer.train import unsupported_torch

    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    addresses = gpu_pci_addresses(count) if count else []
    gpus = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                     "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count,
                     "pci": addresses[i], "numa_node": gpu_numa_node(addresses[i])})
    archs = torch.cuda.get_arch_list() if cuda else []
    driver = (tool_output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")[0] or "").split()
    nccl = None
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError) as exc:
            nccl = f"unknown ({exc})"
    return {
        "host": platform.node(), "python": platform.python_version(), "machine": platform.machine(),
        "torch": torch.__version__, "torch_supported": unsupported_torch(torch.__version__) is None,
        "torch_cuda": torch.version.cuda, "cuda_available": cuda, "nccl": nccl, "torch_archs": archs,
        "gpus": gpus, "driver": driver[0] if driver else None, "flash_attn": _flash_attn(),
        "cpus": os.cpu_count(), "affinity": cpu_ranges(os.sched_getaffinity(0)),
        "numa": {str(n): cpu_ranges(cpus) or "no CPUs" for n, cpus in numa_nodes().items()},
        "numactl": numactl_show()[0], "unserved": sorted({g["capability"] for g in gpus if not _served(g, archs)}),
    }


def _served(gpu: dict, archs: list[str]) -> bool:
    """Whether torch carries kernels for the GPU: its own sm, an earlier minor of its major, or PTX."""
    major, minor = (int(x) for x in gpu["capability"].split("."))
    for arch in archs:
        kind, _, number = arch.partition("_")
        digits = number.rstrip("af")
        if digits.isdigit() and int(digits[:-1]) == major and (int(digits[-1]) <= minor or kind == "compute"):
            return True
    return False


def _flash_attn() -> Optional[str]:
    """flash-attn's version where it imports, `broken: ...` where it is installed and does not, None without it."""
    from trainer.model import flash_import_error

    error, missing = flash_import_error()
    if missing:
        return None
    if error is not None:
        return f"broken: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
    try:
        return importlib.metadata.version("flash-attn") or "?"
    except importlib.metadata.PackageNotFoundError:
        return "?"


def attention(device_name: str) -> dict[str, Any]:
    """One causal attention (GQA's shape after expansion: 2 x 8 heads x 512 x 64) forward and
    backward in bf16 through SDPA's flash backend, SDPA's math path and flash-attn (where it
    imports), each against the math path in fp32: a kernel passes when its largest error is
    within twice the bf16 math path's plus 1% of the values' scale. On the CPU a sound kernel is
    within 1.1% and the math path within 0.5%; a kernel that drops the causal mask is 97% off."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = torch.device(device_name)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 512, 64, generator=gen).to(device) for _ in range(3))
    grad = torch.randn(2, 8, 512, 64, generator=gen).to(device)

    def run(fn, dtype) -> list[torch.Tensor]:
        inputs = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*inputs)
        out.backward(grad.to(dtype))
        return [out.float().detach()] + [t.grad.float() for t in inputs]

    def sdpa(backend):
        def fn(a, b, c):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True)
        return fn

    reference = run(sdpa(SDPBackend.MATH), torch.float32)
    math16 = run(sdpa(SDPBackend.MATH), torch.bfloat16)
    kernels = {"SDPA flash backend": sdpa(SDPBackend.FLASH_ATTENTION)}
    flash = _flash_attn()
    if flash and not flash.startswith("broken") and device.type == "cuda":
        from trainer.model import import_flash_attn

        func = import_flash_attn()  # (batch, seq, heads, dim)
        kernels[f"flash-attn {flash}"] = lambda a, b, c: func(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2),
                                                              causal=True).transpose(1, 2)
    results = {}
    for name, fn in kernels.items():
        try:
            got = run(fn, torch.bfloat16)
        except RuntimeError as exc:  # no kernel for this GPU, dtype or shape: the answer, in one line
            results[name] = {"ok": False, "error": " ".join(str(exc).split())[:300]}
            continue
        errors = {what: {"error": (g - r).abs().max().item(),
                         "bound": 2 * (m - r).abs().max().item() + 1e-2 * r.abs().max().item()}
                  for what, g, m, r in zip(("output", "dq", "dk", "dv"), got, math16, reference)}
        results[name] = {"ok": all(e["error"] <= e["bound"] for e in errors.values()), "errors": errors}
    return {"device": str(device), "dtype": "bfloat16", "shape": [2, 8, 512, 64], "kernels": results,
            "flash_attn": flash}


def allreduce(sizes: list[float], iters: int) -> Optional[dict[str, Any]]:
    """Bus bandwidth of all-reduces of each size across this torchrun world (rank 0's answer)."""
    from datetime import timedelta

    import torch.distributed as dist

    from trainer.parallel import distributed_session

    with distributed_session(timedelta(seconds=120)) as env:
        rows = []
        for megabytes in sizes:
            wrong, numel, per, bus = time_all_reduce(megabytes, iters, env.device)
            rows.append({"mib": megabytes, "ms": per * 1e3, "bus_gbs": bus, "wrong": wrong})
        return {"backend": dist.get_backend(), "world": dist.get_world_size(), "sizes": rows} if env.rank == 0 else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = Parser(prog="python -m trainer.gpucheck", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("node").set_defaults(run=lambda args: node())
    p = sub.add_parser("attention")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.set_defaults(run=lambda args: attention(args.device))
    p = sub.add_parser("allreduce")
    p.add_argument("--sizes", type=float, nargs="+", default=[1.0, 64.0, 1024.0], help="MiB")
    p.add_argument("--iters", type=int, default=10)
    p.set_defaults(run=lambda args: allreduce(args.sizes, args.iters))
    args = parser.parse_args(argv)
    if (result := args.run(args)) is not None:
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
