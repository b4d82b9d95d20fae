"""Stand-ins for podman, enroot and srun, written into a directory put first on PATH.

Each records its argv (and enroot its ENROOT_SQUASH_OPTIONS) as one JSON line in
`calls.jsonl` beside it, so tests assert on the exact command lines the image
code runs. enroot is not packaged anywhere this project is tested; the `real`
mode of the enroot stand-in does what enroot's podman:// import does
(`podman create`, `podman export`, `mksquashfs ... -all-root
$ENROOT_SQUASH_OPTIONS`) so the rest of the flow runs on a real image.

Behaviour is chosen through the environment at call time:
  FAKE_ENROOT_MOUNT=1     enroot's import --help lists `-x` (CSCS's build)
  FAKE_ENROOT_MODE        ok (default: write a small file), fail (half a file,
                          exit 1), hang (half a file, then sleep), exit127 (a
                          whole squashfs, then exit 127),
                          real (the podman export + mksquashfs described above)
  FAKE_PODMAN_FAIL=pull   podman build fails as when the base cannot be pulled
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_PRELUDE = """#!{python}
import json, os, subprocess, sys
from pathlib import Path
HERE = Path(__file__).resolve().parent
STATE = HERE / "state"
STATE.mkdir(exist_ok=True)
with open(HERE / "calls.jsonl", "a") as f:
    f.write(json.dumps({{"argv": [Path(sys.argv[0]).name] + sys.argv[1:],
                        "squash": os.environ.get("ENROOT_SQUASH_OPTIONS")}}) + "\\n")
args = sys.argv[1:]
"""

_PODMAN = """
def tagfile(tag):
    return STATE / ("tag-" + tag.replace("/", "_").replace(":", "__"))
if args[:1] == ["build"]:
    tag = args[args.index("-t") + 1]
    print("STEP 1/2: FROM base", flush=True)
    if os.environ.get("FAKE_PODMAN_FAIL") == "pull":
        print("Error: creating build container: initializing source docker://nvcr.io/nvidia/pytorch:25.01-py3: "
              "pinging container registry nvcr.io: dial tcp: lookup nvcr.io: no such host", flush=True)
        sys.exit(125)
    print("STEP 2/2: CMD [\\"bash\\"]")
    print("COMMIT " + tag)
    tagfile(tag).write_text(tag)
elif args[:2] == ["image", "exists"]:
    sys.exit(0 if tagfile(args[2]).exists() else 1)
elif args[:2] == ["image", "inspect"]:
    if not tagfile(args[-1]).exists():
        sys.exit(125)
    print(4096 if "Size" in args[3] else "sha256:" + "ab" * 32)
elif args[:1] == ["images"]:
    for p in STATE.glob("tag-*"):
        print(p.read_text())
elif args[:1] == ["rmi"]:
    tagfile(args[1]).unlink()
else:
    sys.exit("fake podman: unsupported " + " ".join(args))
"""

_PODMAN_FORBIDDEN = """
sys.exit("podman must not be called here")
"""

_ENROOT = """
if args[:1] == ["version"]:
    print("3.5.0")
    sys.exit(0)
if args[:2] == ["import", "--help"]:
    print("Usage: enroot import [options] [--] URI\\n\\n Options:\\n   -a, --arch    Architecture of the image")
    if os.environ.get("FAKE_ENROOT_MOUNT") == "1":
        print("   -x, --xtra    mount: import through podman mount instead of an export")
    print('   -o, --output  Name of the output image file (defaults to "URI.sqsh")')
    sys.exit(0)
assert args[0] == "import", args
out = Path(args[args.index("-o") + 1])
uri = args[-1]
if out.exists():
    print("[ERROR] File already exists: " + str(out))
    sys.exit(1)
mode = os.environ.get("FAKE_ENROOT_MODE", "ok")
print("[INFO] Fetching image " + uri, flush=True)
if mode == "ok":
    out.write_bytes(b"hsqs" + b"\\0" * 1000)
elif mode == "hang":
    import time
    out.write_bytes(b"hsqs-half")
    print("[INFO] Creating squashfs filesystem...", flush=True)
    time.sleep(120)
elif mode == "fail":
    out.write_bytes(b"hsqs-half")
    print("[ERROR] mksquashfs: write failed")
    sys.exit(1)
elif mode in ("exit127", "real"):
    import shutil, tempfile
    work = Path(tempfile.mkdtemp(prefix="enroot-standin-"))
    try:
        rootfs = work / "rootfs"
        rootfs.mkdir()
        if mode == "real":
            podman = shutil.which("podman")
            cid = subprocess.run([podman, "create", uri.split("://", 1)[1]], check=True,
                                 capture_output=True, text=True).stdout.strip()
            try:
                exp = subprocess.Popen([podman, "export", cid], stdout=subprocess.PIPE)
                subprocess.run(["tar", "-C", str(rootfs), "-x"], stdin=exp.stdout, check=True)
                if exp.wait() != 0:
                    sys.exit("podman export failed")
            finally:
                subprocess.run([podman, "rm", cid], capture_output=True)
        else:
            (rootfs / "etc").mkdir()
            (rootfs / "etc" / "hello").write_text("hello")
        opts = os.environ.get("ENROOT_SQUASH_OPTIONS", "-comp lzo -noD").split()
        subprocess.run(["mksquashfs", str(rootfs), str(out), "-all-root", "-noappend", "-quiet", *opts], check=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if mode == "exit127":
        print("enroot-aufs2ovlfs: command not found")
        sys.exit(127)
else:
    sys.exit("unknown FAKE_ENROOT_MODE " + mode)
"""

_SRUN = """
# Drop srun's own --options, then run the task command in place.
i = 0
while i < len(args) and args[i].startswith("--"):
    i += 1
os.execvp(args[i], args[i:])
"""


def write_standins(bin_dir: Path, *tools: str, python: str = sys.executable) -> Path:
    """Write the named stand-ins (podman, enroot, srun, podman-forbidden) into `bin_dir`."""
    bodies = {"podman": _PODMAN, "enroot": _ENROOT, "srun": _SRUN, "podman-forbidden": _PODMAN_FORBIDDEN}
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        script = bin_dir / tool.split("-")[0]
        script.write_text(_PRELUDE.format(python=python) + bodies[tool])
        script.chmod(0o755)
    return bin_dir


def calls(bin_dir: Path, tool: str | None = None) -> list[dict]:
    log = bin_dir / "calls.jsonl"
    if not log.exists():
        return []
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    return [e for e in entries if tool is None or e["argv"][0] == tool]
