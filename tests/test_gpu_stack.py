"""What a GPU run's stack will be, said before an allocation: `slipway doctor` and the dry run
name the image's CUDA, the network NCCL is forced onto and the Container Engine's aws_ofi_nccl
hook variant, and compare flash-attn's compiled architectures with the nodes' GPUs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from containers.record import BuildRecord
from test_pinned import fake_build, pin_config, slipway  # noqa: F401  (a fixture)

GH200 = ["container.runtime=edf", "launch.preset=alps-gh200", "slurm.gpus_per_node=4", "launch.procs_per_node=4",
         "slurm.cpus_per_task=72", "parallel.dp=4"]
HOOK = "container.annotations.com.hooks.aws_ofi_nccl"


def built(project: Path, cuda: str | None, *overrides: str) -> Path:
    """A build of configs/pin.yaml whose record says the image's CUDA is `cuda`."""
    squashfs = fake_build(project, *GH200, *overrides)
    record = BuildRecord.beside(squashfs)
    squashfs.with_suffix(".json").write_text(dataclasses.replace(record, cuda=cuda).to_json())
    return squashfs


def lines(out: str, name: str) -> list[str]:
    return [line for line in out.splitlines() if f" {name}: " in line]


@pytest.mark.parametrize("variant, ok", [("cuda13", True), ("cuda12", False)])
def test_doctor_names_the_hook_variant_against_the_images_cuda(project, pin_config, variant, ok):
    built(project, "13.1.0.036")
    args = ["doctor", pin_config, *GH200, f"{HOOK}.enabled=true", f"{HOOK}.variant={variant}"]
    out = slipway(*args).stdout
    (cuda,) = lines(out, "image CUDA")
    assert cuda.startswith("ok   image CUDA: 13.1.0.036 (the image's CUDA_VERSION, build "), out
    (net,) = lines(out, "NCCL network")
    assert f"the Container Engine's aws_ofi_nccl hook, variant {variant}; NCCL_NET='AWS Libfabric' (launch.preset " \
           "alps-gh200): NCCL stops where its plugin is missing" in net
    if ok:
        assert net.startswith("ok ")
    else:
        assert net.startswith("fail NCCL network: ") and net.endswith(
            "the variant is for another CUDA than the image's 13.1.0.036, so the plugin may not load: set "
            "container.annotations.com.hooks.aws_ofi_nccl.variant: cuda13")
    (flash,) = lines(out, "flash-attn")
    assert flash == "ok   flash-attn: flash-attn compiled for CUDA architectures 90; the nodes (alps-gh200) are " \
                    "compute capability 9.0"
    # The dry run says the same, as notes, before the script.
    dry = slipway("submit", *args[1:], "--dry-run").stdout
    assert any(line.startswith("note: NCCL network: ") and f"variant {variant}" in line for line in dry.splitlines())
    assert "note: image CUDA: 13.1.0.036" in dry


def test_doctor_refuses_flash_attn_built_for_other_gpus_and_notes_what_it_cannot_know(project, pin_config):
    built(project, None, "image.build_args.FLASH_ATTN_CUDA_ARCHS=80")
    out = slipway("doctor", pin_config, *GH200, "image.build_args.FLASH_ATTN_CUDA_ARCHS=80").stdout
    (flash,) = lines(out, "flash-attn")
    assert flash == ("fail flash-attn: flash-attn compiled for CUDA architectures 80, which no GPU of compute "
                     "capability 9.0 (alps-gh200) runs: set image.build_args.FLASH_ATTN_CUDA_ARCHS: '90' and "
                     "rebuild, or model.attention: sdpa")
    (cuda,) = lines(out, "image CUDA")
    assert "unknown (a build record from before slipway kept it: rebuild to record it)" in cuda
    (net,) = lines(out, "NCCL network")  # the hook is off: the image must bring the plugin
    assert net.startswith("ok   NCCL network: the Container Engine's aws_ofi_nccl hook is off; NCCL_NET=") and \
        "note: the image must bring the plugin itself" in net
    # sdpa: flash-attn's kernels are never asked for.
    assert not lines(slipway("doctor", pin_config, *GH200, "image.build_args.FLASH_ATTN_CUDA_ARCHS=80",
                             "model.attention=sdpa").stdout, "flash-attn")


def test_a_cpu_job_has_no_gpu_stack_to_name(project, pin_config):
    fake_build(project)
    out = slipway("doctor", pin_config, "container.runtime=edf").stdout
    assert not lines(out, "image CUDA") and not lines(out, "NCCL network") and not lines(out, "flash-attn")
