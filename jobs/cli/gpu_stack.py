"""What a GPU run's ranks get from the image and the nodes (doctor's checks, `submit --dry-run`'s notes):
the image's CUDA, NCCL's network and the Container Engine's aws_ofi_nccl hook variant against that CUDA,
flash-attn's compiled architectures against the nodes' compute capability."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Optional

from containers.record import BuildRecord
from common.errors import ConfigError
from edf import Environment, resolve_base
from jobs.config import Config
from jobs.config.sections import NODE_PRESETS
from jobs.runs.image import ImagePin

Result = tuple[str, bool, str]  # (name, ok, detail or the fix)

HOOK = "com.hooks.aws_ofi_nccl"  # the Container Engine's hook that brings the aws-ofi-nccl plugin into the container


def gpu_stack(cfg: Config, env: Environment, pin: ImagePin) -> list[Result]:
    """The module's checks of a run of `cfg` in `env` on the image `pin`; empty for a CPU job."""
    if not cfg.slurm.gpus_per_node:
        return []
    record = BuildRecord.beside(Path(pin.path)) if pin.path else None
    cuda = record.cuda if record else None
    said = (f"{cuda} (the image's CUDA_VERSION, build {record.hash12})" if cuda
            else "unknown (a build record from before slipway kept it: rebuild to record it)" if record
            else "unknown (no build record of slipway's for this image)")
    return [("image CUDA", True, said), _nccl_network(cfg, env, cuda), *_flash_attn(cfg, record)]


def _nccl_network(cfg: Config, env: Environment, cuda: Optional[str]) -> Result:
    preset = NODE_PRESETS.get(cfg.launch.preset)
    net = cfg.launch.env.get("NCCL_NET") or dict(preset.env if preset else ()).get("NCCL_NET")
    source = "launch.env" if "NCCL_NET" in cfg.launch.env else f"launch.preset {cfg.launch.preset}"
    forced = f"NCCL_NET={net!r} ({source}): NCCL stops where its plugin is missing" if net else \
        "NCCL_NET unset: NCCL picks the network it finds"
    if cfg.container.runtime != "edf":
        where = "the nodes' own" if cfg.container.runtime == "none" else "the image's own (pyxis runs no CE hook)"
        return ("NCCL network", True, f"{where} NCCL and plugin; {forced}")
    with contextlib.suppress(ConfigError, OSError):  # a site's base EDF may enable the hook
        env = resolve_base(env) if env.base_environment else env
    major = cuda.split(".")[0] if cuda else None
    fix = f"container.annotations.{HOOK}.variant: cuda{major}" if major else ""
    variant = env.annotations.get(f"{HOOK}.variant")
    if env.annotations.get(f"{HOOK}.enabled", "").lower() != "true":
        said = f"the Container Engine's aws_ofi_nccl hook is off; {forced}"
        if net:
            said += (f"; note: the image must bring the plugin itself (CSCS's alps images do), else set "
                     f"container.annotations.{HOOK}.enabled: 'true'" + (f" and {fix}" if fix else ""))
        return ("NCCL network", True, said)
    said = f"the Container Engine's aws_ofi_nccl hook, variant {variant or 'unset (the site default)'}; {forced}"
    if variant and major and re.fullmatch(r"cuda\d+", variant) and variant != f"cuda{major}":
        return ("NCCL network", False, f"{said}: the variant is for another CUDA than the image's {cuda}, so the "
                                       f"plugin may not load: set {fix}")
    return ("NCCL network", True, said + (f"; note: set {fix} to match the image's CUDA" if not variant and fix else ""))


def _flash_attn(cfg: Config, record: Optional[BuildRecord]) -> list[Result]:
    """flash-attn's compiled architectures against the nodes' (the node preset's) compute capability."""
    if record is None or not record.flash_attn_archs or cfg.model.attention == "sdpa":
        return []
    preset = NODE_PRESETS.get(cfg.launch.preset)
    archs = f"flash-attn compiled for CUDA architectures {record.flash_attn_archs}"
    if preset is None or not preset.capability:
        return [("flash-attn", True, f"{archs}; the nodes' compute capability is not known here (no launch.preset): "
                                     "slipway gpu-check, run on a node, reports it")]
    if record.flash_attn_serves(preset.capability):
        return [("flash-attn", True, f"{archs}; the nodes ({cfg.launch.preset}) are compute capability "
                                     f"{preset.capability}")]
    return [("flash-attn", False, f"{archs}, which no GPU of compute capability {preset.capability} "
                                  f"({cfg.launch.preset}) runs: set image.build_args.FLASH_ATTN_CUDA_ARCHS: "
                                  f"'{preset.capability.replace('.', '')}' and rebuild, or model.attention: sdpa")]
