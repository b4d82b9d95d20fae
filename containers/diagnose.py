"""Why a `podman build` failed, in one line: the line that explains it, and the fix.

podman ends every failure with its own trailer and crun adds noise after the real error, so the
last error-like line rarely explains anything: the diagnosis reads only the failing step's output
(after the last `STEP` line) and quotes the line that matched a known failure (the table below,
most specific first); flash-attn is blamed only when its own step failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

STEP = re.compile(r"^(STEP \d+/\d+): ")
# The one RUN instruction that names this build arg is the flash-attn step (tests check it; its ARG
# line names it too, but an ARG cannot fail).
FLASH_ATTN_STEP_MARK = "FLASH_ATTN_VERSION"
# The Dockerfile's RUN steps by a text only theirs holds (test_dockerfile_contract checks each is in one RUN).
STEP_NAMES = (("the flash-attn step", FLASH_ATTN_STEP_MARK), ("the numactl step", "numactl FAILED"),
              ("the dependencies step", "pip_requirements.py"), ("the sources step", "--no-deps"),
              ("the smoke test", '"$SMOKE"'))
# podman's trailer and crun's follow-up noise: never the cause.
NOISE = re.compile(r"^(subprocess exited with status|Error: building at STEP|error building at STEP|: exit status \d+$|"
                   r"time=\S+ level=error msg=\"did not get container create message)|^\$ ")
ERROR_LIKE = re.compile(r"error|failed|denied|no such host|not found|cannot|killed", re.I)
QUOTE_MAX = 300
OWN_QUOTE_MAX = 700  # slipway's own lines end with their fix: keep it


@dataclass(frozen=True)
class Known:
    """A failure users meet: how its line looks, and what to do."""

    name: str
    pattern: re.Pattern
    fix: str
    flash_fix: Optional[str] = None  # instead of `fix` when the flash-attn step failed
    first: bool = False  # quote the first match (a compiler's first error), else the last
    from_step_only: bool = False  # only when the failing step is FROM (pulling the base)
    quote_max: int = QUOTE_MAX


def _re(text: str) -> re.Pattern:
    return re.compile(text, re.I)


CHROOT_ROUTE = "set image.isolation: chroot (RUN steps then run without an OCI runtime)"
WHEEL_ROUTE = ("put a flash_attn wheel built for this base's Python, torch and CUDA into image.wheelhouse "
               "(installed instead of compiling)")
KNOWN: tuple[Known, ...] = (
    Known("disk", _re(r"no space left on device|\bENOSPC\b|disk quota exceeded"),
          "free disk where podman keeps its storage (graphroot and runroot in storage.conf; `slipway doctor` "
          "shows where) and in TMPDIR, or move them to a larger local disk (on CSCS: /dev/shm on a compute "
          "node with image.build_on: compute)"),
    Known("pull", _re(r"creating build container|initializing source|pull access denied|manifest unknown|"
                      r"unable to pull|pinging container registry|requested access to the resource is denied|"
                      r"short-name .* did not resolve|reading manifest|repository .* not found|"
                      r"authentication required|unauthorized"),
          "check the network (on CSCS set image.network_host: true), log in (`podman login nvcr.io`), or set "
          "image.base_image to an image podman has locally", from_step_only=True),
    Known("cgroups", _re(r"cgroups? in hybrid mode not supported|cannot (set up|create|enter) cgroup|"
                         r"cgroup.*(not supported|read-only file system|no such file or directory)"),
          "podman's OCI runtime cannot create containers with this host's cgroups: " + CHROOT_ROUTE),
    Known("setrlimit", _re(r"setrlimit"),
          "podman's OCI runtime may not set the container's resource limits here: " + CHROOT_ROUTE),
    Known("subuid", _re(r"newuidmap|newgidmap|not enough (UIDs|IDs|GIDs)|cannot find UID/GID for user|"
                        r"insufficient UIDs or GIDs"),
          "rootless podman needs subordinate IDs for your user: an admin adds `USER:100000:65536` to /etc/subuid "
          "and /etc/subgid, then run `podman system migrate`"),
    Known("runtime", _re(r"OCI runtime|error running container|\bcrun: |\brunc: |creating container for \["),
          "podman could not start a container for this RUN step: set image.isolation: chroot"),
    # Slipway's own checks (the Dockerfile, trainer.smoke) print "WHAT FAILED: why: fix".
    Known("smoke", re.compile(r"^\s*smoke FAILED: "),
          "the smoke test runs one training step inside the image; `python -m trainer.smoke` runs it outside",
          quote_max=OWN_QUOTE_MAX),
    Known("slipway", re.compile(r"^\s*(flash-attn|torch|slipway|dependencies|numactl) FAILED: "), "",  # holds its fix
          quote_max=OWN_QUOTE_MAX),
    Known("compiler-oom", _re(r"Killed signal terminated program|died due to signal 9|signal 9 \(Kill signal\)|"
                              r"virtual memory exhausted|cc1plus: out of memory|fatal error: Killed|"
                              r"std::bad_alloc"),
          "a compiler ran out of memory: lower MAX_JOBS (`MAX_JOBS=2 make image`, or image.build_args.MAX_JOBS)",
          flash_fix="the compiler ran out of memory building flash-attn (about 9 GB per job at NVCC_THREADS=4): "
                    "lower MAX_JOBS (`MAX_JOBS=2 make image`, or image.build_args.MAX_JOBS), compile for your GPU "
                    "only (image.build_args.FLASH_ATTN_CUDA_ARCHS: \"90\" for H100/GH200), or " + WHEEL_ROUTE),
    Known("no-cuda", _re(r"CUDA_HOME environment variable is not set|No CUDA runtime is found|"
                         r"nvcc: (command )?not found|cuda_runtime(_api)?\.h: No such file"),
          "no CUDA toolkit in the base image: build on a CUDA base such as NGC's PyTorch image",
          flash_fix="flash-attn compiles against the base's CUDA toolkit and this base has none: set "
                    "image.flash_attn: false for a CPU base, or use a CUDA base such as NGC's PyTorch image"),
    Known("compile", _re(r"^\s*\S+\.(cu|cuh|cpp|cc|cxx|c|h|hpp|hxx|inl)(\(\d+\)|:\d+(:\d+)?):?\s.*\berror\b|"
                         r"^\s*nvcc fatal|: fatal error: |\berror: command '[^']*' failed"),
          "a package did not compile against the base image: the quoted line is the compiler's first error",
          flash_fix="flash-attn {FLASH_ATTN_VERSION} does not compile against this base's torch and CUDA (the "
                    "quoted line is the compiler's first error): set image.build_args.FLASH_ATTN_VERSION to a "
                    "release that supports them, " + WHEEL_ROUTE + ", or set image.flash_attn: false", first=True),
    Known("tls", _re(r"CERTIFICATE_VERIFY_FAILED|SSLError|SSL: "),
          "pip inside the build cannot verify TLS (the container's CA store is not the host's): download the "
          "wheels on the host (`pip download -d DIR ...`) and set image.wheelhouse: DIR"),
    Known("network", _re(r"Failed to establish a new connection|Temporary failure in name resolution|"
                         r"Name or service not known|Network is unreachable|Max retries exceeded|ProxyError|"
                         r"Could not fetch URL"),
          "pip inside the build cannot reach the package index: set image.network_host: true (needed on CSCS), or "
          "install offline from image.wheelhouse"),
    Known("missing", _re(r"No matching distribution found for|Could not find a version that satisfies the requirement"),
          "{MISSING_FIX}",
          flash_fix="flash-attn=={FLASH_ATTN_VERSION} cannot be found{WHERE}: " + WHEEL_ROUTE + ", or its source "
                    "to compile (`FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps --no-build-isolation "
                    "--no-binary :all: flash-attn==VERSION -d WHEELHOUSE` in an environment with torch), or set "
                    "image.flash_attn: false"),
    Known("conflict", _re(r"ResolutionImpossible|conflicting dependencies|Cannot install .* because"),
          "the requirements conflict (the base's torch is pinned to the version it has): relax the conflicting "
          "pin in pyproject.toml or pick a base image whose packages fit (the log lists the conflict)"),
    Known("wheel-build", _re(r"Failed building wheel for|Could not build wheels for|metadata-generation-failed|"
                             r"subprocess-exited-with-error"),
          "pip could not build a package from source: put a prebuilt wheel for the image's Python into "
          "image.wheelhouse, or see the log for the build's own error",
          flash_fix="pip could not build flash-attn (see the log): " + WHEEL_ROUTE + ", or set "
                    "image.flash_attn: false"),
)

_TRACEBACK_END = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit)|KeyboardInterrupt)(: |$)")


def excerpt(line: str, match: Optional[re.Match] = None, limit: int = QUOTE_MAX) -> str:
    """At most `limit` characters of `line`, keeping its start and the text around the match
    (crun's errors put the whole RUN command before the part that explains them)."""
    offset = len(line) - len(line.lstrip())
    line = line.strip()
    if len(line) <= limit:
        return line
    if match is None or match.end() - offset <= limit - 1:
        return line[: limit - 1] + "…"
    start = max(match.start() - offset - 80, 60)
    end = min(len(line), start + limit - 62)
    return line[:60] + " … " + line[start:end] + ("…" if end < len(line) else "")


def failing_step(lines: list[str]) -> tuple[str, list[str]]:
    """The failing step's STEP line ("" before the first) and its output, without podman's noise."""
    last = max((i for i, line in enumerate(lines) if STEP.match(line)), default=-1)
    step = " ".join(lines[last].split()) if last >= 0 else ""
    return step, [line for line in lines[last + 1:] if line.strip() and not NOISE.match(line.strip())]


def _is_run(step: str) -> bool:
    return bool(re.match(r"^STEP \d+/\d+: RUN ", step))


def step_name(step: str) -> str:
    """'the flash-attn step (STEP 9/21)' for the Dockerfile's known steps, else the step's text."""
    if not step:
        return "the start"
    number = STEP.match(step)
    for name, mark in STEP_NAMES:
        if mark in step and number and _is_run(step):
            return f"{name} ({number.group(1)})"
    return step if len(step) <= 100 else step[:99] + "…"


def diagnose_build(text: str, *, build_args: dict[str, str], log: Path, rc: int) -> str:
    """One line for a failed `podman build`: where, the line that explains it, the fix, the log."""
    step, body = failing_step(text.splitlines())
    from_step = not step or bool(re.match(r"^STEP \d+/\d+: FROM ", step))
    flash_step = build_args.get("FLASH_ATTN") == "1" and _is_run(step) and FLASH_ATTN_STEP_MARK in step
    where = step_name(step)
    offline = build_args.get("WHEELHOUSE") == "offline"
    values = {
        "FLASH_ATTN_VERSION": build_args.get("FLASH_ATTN_VERSION") or "(the Dockerfile's FLASH_ATTN_COMPILE_VERSION)",
        "WHERE": " in the offline wheelhouse (image.wheelhouse)" if offline else " on the index",
        "MISSING_FIX": ("the offline wheelhouse (image.wheelhouse) lacks it for the image's Python and platform: "
                        "add it on the host (`pip download -d WHEELHOUSE --only-binary=:all: --python-version X.Y "
                        "--platform PLATFORM PACKAGE`)") if offline else
                       ("check the requirement's name and version in pyproject.toml and the network (image."
                        "network_host: true), or install offline from image.wheelhouse"),
    }
    for known in KNOWN:
        hits = [(line, m) for line in body if (m := known.pattern.search(line))]
        if not hits or (known.from_step_only and not from_step):
            continue
        quote = excerpt(*hits[0 if known.first else -1], limit=known.quote_max)
        fix = (known.flash_fix if flash_step and known.flash_fix else known.fix).format(**values)
        fix = f". Fix: {fix}" if fix else ""
        if known.name == "pull":
            return f"podman could not pull the base image {build_args.get('BASE_IMAGE')}: {quote}{fix}; full log: {log}"
        return f"podman build failed at {where} (exit {rc}): {quote}{fix}; full log: {log}"
    # Nothing known: the last line that ends a traceback, else the last error-like one, else the last.
    ends = [line for line in body if _TRACEBACK_END.match(line)]
    errors = [line for line in body if ERROR_LIKE.search(line)]
    pick = ends[-1] if ends else errors[-1] if errors else body[-1] if body else "(no output)"
    hint = (". Fix: flash-attn builds against the base's torch and CUDA: " + WHEEL_ROUTE + ", lower MAX_JOBS if "
            "the compiler was killed, or set image.flash_attn: false") if flash_step else ""
    return f"podman build failed at {where} (exit {rc}): {excerpt(pick)}{hint}; full log: {log}"
