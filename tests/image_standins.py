"""Stand-ins for podman, enroot and srun, written into a directory put first on PATH.

Each records its argv (and enroot its ENROOT_SQUASH_OPTIONS) as one JSON line in
`calls.jsonl` beside it, so tests assert on the exact command lines the image
code runs. enroot is not packaged anywhere this project is tested; its stand-in
does what upstream enroot's podman:// import does (src/docker.sh): a work dir
`$ENROOT_TEMP_PATH/enroot.XXXXXXXXXX`, `podman create --name` with that dir's
name (the PATH's podman: the stand-in, or the real one in `real` mode), the
squashfs, then its exit trap removes the dir and calls `docker rm`, which fails
where only podman exists: the stopped container stays and enroot exits 1.

The podman stand-in keeps tags (with the labels `build --label` gave them) and containers as
files under state/; like podman, containers carry their image's labels, and it refuses `rmi` of a
tag a container was created from.

Behaviour is chosen through the environment at call time:
  FAKE_ENROOT_MOUNT=1     enroot's import --help lists `-x` (CSCS's build)
  FAKE_ENROOT_MODE        upstream (default: a whole squashfs, the container
                          left, exit 1), docker (the same with a working
                          `docker rm`: nothing left, exit 0), fail (half a
                          file, container left, exit 1), hang (half a file,
                          then sleep), exit127 (a whole squashfs and no
                          container, then exit 127), real (upstream on the real
                          podman: podman export + mksquashfs)
  FAKE_ENROOT_WAIT=PATH   after `podman create`, wait (at most 5 minutes) until PATH exists:
                          an import that is still running
  FAKE_PODMAN_FAIL=pull   podman build fails as when the base cannot be pulled
  FAKE_PODMAN_FAIL=disk   podman build fails as when its storage is full
  FAKE_PODMAN_RM_FAIL=RE  `podman rm` fails for containers whose name matches RE
  FAKE_IMAGE_ENV          lines VAR=VALUE the image's ENV has besides PATH
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
import re, secrets, time
def tagfile(tag):
    return STATE / ("tag-" + tag.replace("/", "_").replace(":", "__"))
def read_tag(tag):
    return json.loads(tagfile(tag).read_text())
def containers():
    return [json.loads(p.read_text()) for p in sorted(STATE.glob("ctr-*.json"))]
def find(ident):
    for c in containers():
        if ident in (c["Id"], c["Names"][0]):
            return c
    print('Error: no container with name or ID "' + ident + '" found: no such container')
    sys.exit(1)
if args[:1] == ["build"]:
    tag = args[args.index("-t") + 1]
    print("STEP 1/2: FROM base", flush=True)
    if os.environ.get("FAKE_PODMAN_FAIL") == "disk":
        print("Error: committing container for step: copying layers: write /var/tmp/x: no space left on device",
              flush=True)
        sys.exit(125)
    if os.environ.get("FAKE_PODMAN_FAIL") == "pull":
        print("Error: creating build container: initializing source docker://nvcr.io/nvidia/pytorch:25.12-py3: "
              "pinging container registry nvcr.io: Get \\"https://nvcr.io/v2/\\": dial tcp: lookup nvcr.io: "
              "no such host", flush=True)
        sys.exit(125)
    print("STEP 2/2: CMD [\\"bash\\"]")
    print("COMMIT " + tag)
    labels = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--label")
    tagfile(tag).write_text(json.dumps({"name": tag, "labels": labels}))
elif args[:2] == ["image", "exists"]:
    sys.exit(0 if tagfile(args[2]).exists() else 1)
elif args[:2] == ["image", "inspect"]:
    if not tagfile(args[-1]).exists():
        sys.exit(125)
    if "Config.Env" in args[3]:  # one VAR=VALUE a line, as podman's range over the image's ENV prints it
        print("PATH=/usr/local/bin:/usr/bin\\n" + os.environ.get("FAKE_IMAGE_ENV", ""))
    else:
        print(4096 if "Size" in args[3] else "ab" * 32)
elif args[:1] == ["images"]:
    rows = [json.loads(p.read_text()) for p in sorted(STATE.glob("tag-*"))]
    if "json" in args:
        print(json.dumps([{"Id": "ab" * 32, "Names": [r["name"]], "Labels": r["labels"] or None} for r in rows]))
    else:
        for r in rows:
            print(r["name"])
elif args[:1] == ["rmi"]:
    users = [c["Id"] for c in containers() if c["Image"] == args[1]]
    if users:
        print("Error: image used by " + users[0] + ": image is in use by a container: consider listing external "
              "containers and force-removing image")
        sys.exit(2)
    tagfile(args[1]).unlink()
elif args[:1] == ["create"]:
    name, image = args[args.index("--name") + 1], args[args.index("--name") + 2]
    if not tagfile(image).exists():
        print("Error: " + image + ": image not known")
        sys.exit(125)
    cid = secrets.token_hex(32)
    (STATE / ("ctr-" + cid + ".json")).write_text(json.dumps(
        {"Id": cid, "Names": [name], "Image": image, "ImageID": "ab" * 32, "State": "created",
         "Created": int(time.time()), "Labels": read_tag(image)["labels"]}))
    print(cid)
elif args[:2] == ["ps", "--all"]:
    pattern = args[args.index("--filter") + 1].split("=", 1)[1]
    print(json.dumps([c for c in containers() if re.search(pattern, c["Names"][0])]))
elif args[:1] == ["rm"]:
    c = find(args[-1])
    fail = os.environ.get("FAKE_PODMAN_RM_FAIL")
    if fail and re.search(fail, c["Names"][0]):
        print("Error: cleaning up storage: removing container " + c["Id"] + " root filesystem: "
              "unlinkat /var/lib/containers/storage/overlay/x/merged: device or resource busy")
        sys.exit(2)
    (STATE / ("ctr-" + c["Id"] + ".json")).unlink()
    print(c["Id"])
else:
    sys.exit("fake podman: unsupported " + " ".join(args))
"""

_PODMAN_FORBIDDEN = """
sys.exit("podman must not be called here")
"""

_ENROOT = """
import shutil, tempfile
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
image = uri.split("://", 1)[1]
if out.exists():
    print("[ERROR] File already exists: " + str(out))
    sys.exit(1)
mode = os.environ.get("FAKE_ENROOT_MODE", "upstream")
if mode not in ("upstream", "docker", "fail", "hang", "exit127", "real"):
    sys.exit("unknown FAKE_ENROOT_MODE " + mode)
podman = shutil.which("podman")


def squash(rootfs):
    if shutil.which("mksquashfs") is None:  # no squashfs-tools: then no unsquashfs reads it back either
        out.write_bytes(b"hsqs" + b"\\0" * 1000)
        return
    opts = os.environ.get("ENROOT_SQUASH_OPTIONS", "-comp lzo -noD").split()
    subprocess.run(["mksquashfs", str(rootfs), str(out), "-all-root", "-noappend", "-quiet", *opts], check=True)


# Like enroot: mktemp -d -p $ENROOT_TEMP_PATH enroot.XXXXXXXXXX; the container is named after it.
import random, string
work = Path(os.environ.get("ENROOT_TEMP_PATH") or tempfile.gettempdir()) / ("enroot." + "".join(
    random.choices(string.ascii_letters + string.digits, k=10)))
work.mkdir()
print("[INFO] Fetching image", flush=True)
if mode != "exit127":
    created = subprocess.run([podman, "create", "--name", work.name, image], capture_output=True, text=True)
    print(created.stdout + created.stderr, flush=True)  # enroot sends podman's output to stderr
    if created.returncode != 0:
        shutil.rmtree(work)
        sys.exit(created.returncode)
wait = os.environ.get("FAKE_ENROOT_WAIT")
if wait:
    import time
    print("[INFO] waiting for " + wait, flush=True)
    deadline = time.time() + 300
    while not Path(wait).exists() and time.time() < deadline:
        time.sleep(0.1)
rootfs = work / "rootfs"
rootfs.mkdir()
if mode == "hang":
    import time
    out.write_bytes(b"hsqs-half")
    print("[INFO] Creating squashfs filesystem...", flush=True)
    time.sleep(120)
elif mode == "fail":
    out.write_bytes(b"hsqs-half")
    print("[ERROR] mksquashfs: write failed")
else:
    print("[INFO] Extracting image content...", flush=True)
    if mode == "real":
        exp = subprocess.Popen([podman, "export", work.name], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-C", str(rootfs), "-x"], stdin=exp.stdout, check=True)
        if exp.wait() != 0:
            sys.exit("podman export failed")
    else:
        (rootfs / "etc").mkdir()
        (rootfs / "etc" / "hello").write_text("hello")
    print("[INFO] Creating squashfs filesystem...", flush=True)
    squash(rootfs)
# The exit trap: remove the work dir, then `docker rm -f -v NAME` (output to /dev/null).
shutil.rmtree(work, ignore_errors=True)
if mode == "exit127":
    print("enroot-aufs2ovlfs: command not found")
    sys.exit(127)
if mode == "docker":  # a working docker (e.g. podman-docker): the container goes
    subprocess.run([podman, "rm", "-f", "-v", work.name], capture_output=True)
    sys.exit(0)
sys.exit(1)  # docker rm failed, and enroot runs under `set -e`
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


def tiny_base(podman: str = "podman") -> str:
    """The smallest base a real build can RUN in: this machine's /bin/sh and the libraries it
    loads, imported as `localhost/slipway-test-tiny:DIGEST` (made once, kept for the next run;
    a shell builtin is all its steps need). Nothing is downloaded."""
    import hashlib
    import io
    import re
    import shutil
    import subprocess
    import tarfile

    shell = Path(shutil.which("sh") or "/bin/sh").resolve()
    libs = re.findall(r"(/\S+\.so[.\d]*) \(0x", subprocess.run(["ldd", str(shell)], capture_output=True,
                                                               text=True).stdout)
    files = {"bin/sh": shell, **{lib.lstrip("/"): Path(lib).resolve() for lib in libs}}
    digest = hashlib.sha256("".join(f"{k} {file_digest(v)}\n" for k, v in sorted(files.items())).encode())
    tag = f"localhost/slipway-test-tiny:{digest.hexdigest()[:12]}"
    if subprocess.run([podman, "image", "exists", tag]).returncode == 0:
        return tag
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        for d in ("tmp", "opt"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        for name, src in sorted(files.items()):
            tar.add(str(src), arcname=name)
    subprocess.run([podman, "import", "-", tag], input=data.getvalue(), check=True, capture_output=True)
    return tag


def file_digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def flash_attn_standin_wheel(directory: Path, version: str, marker: str = "") -> Path:
    """A pure-Python `flash_attn` wheel that imports and says its version, as a base or a wheelhouse
    would hold a real one (which needs CUDA to import). `marker` makes its bytes unique, so the
    wheelhouse's digest, and with it the image's flash-attn layer, changes on each test run."""
    import base64
    import hashlib
    import zipfile

    dist = f"flash_attn-{version}.dist-info"
    files = {
        "flash_attn/__init__.py": f'"""Stand-in for flash-attn (tests). {marker}"""\n__version__ = "{version}"\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: flash_attn\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: slipway-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(text: str) -> str:
        raw = hashlib.sha256(text.encode()).digest()
        return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    record = "".join(f"{name},{digest(body)},{len(body.encode())}\n" for name, body in files.items())
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"flash_attn-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, body in {**files, f"{dist}/RECORD": record + f"{dist}/RECORD,,\n"}.items():
            zf.writestr(name, body)
    return wheel
