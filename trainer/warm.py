"""Warm ranks: ranks forked from a process that has already paid for the interpreter, torch and
the other heavy imports, each importing its run's own code (`slipway run`; docs/runs.md).

    python3 .../trainer/warm.py serve SOCKET --code DIR    # one per node, allocation and key (a Slurm step)

Run as a file: a warm process holds no module of trainer/ nor common/, only its own code
(warm_rank.CODE: this file and warm_rank.py, a rank's side, imported from its folder). It binds
SOCKET-NODE.sock in SOCKET's folder, the user's alone, beside the allocation's secret (JOB.secret,
JOB from SLURM_JOB_ID); each side proves the secret by an HMAC over the other's random challenge
(as CPython's forkserver does), and a message off the protocol ends its connection only. A rank
starts warm only where it then starts as it would cold (`Warm.refusal`: its environment but for
PER_LAUNCH, the modules its sys.path finds, unchanged on disk, no thread that outlives a fork),
with its task's streams, environment, directory, umask, CPUs, sys.path and fresh global generators
(an unset PYTHONHASHSEED draws one seed per warm process); else its task execs it cold, saying why.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import glob
import hmac
import importlib.util
import json
import os
import re
import secrets
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

# Its own code, from its folder whether sys.path holds that or not (PYTHONSAFEPATH: it does not).
_rank_spec = importlib.util.spec_from_file_location("warm_rank", Path(__file__).with_name("warm_rank.py"))
sys.modules["warm_rank"] = importlib.util.module_from_spec(_rank_spec)
_rank_spec.loader.exec_module(sys.modules["warm_rank"])
from warm_rank import CODE, MAX_MESSAGE, NODE, OWN, Cold, allocation_secret, finish, mac, say, secret_path, send

PROOF_SECONDS = 10  # a connection that has not proved itself by then is closed
REPORT = "report"  # a forked rank's channel back (Warm.conns)
# Set per launch, step or rank (by Slurm, its GPU binding, the launcher, the shell, slipway) and
# read by no import, the devices at their first use: where a rank's environment may differ from its
# warm process's (PYTHONPATH: see `_shadowed`).
PER_LAUNCH = re.compile(r"(SLURM|SLURMD|PMI|PMIX|SLIPWAY)_\w*|((LOCAL|GROUP|ROLE)_)?(RANK|WORLD_SIZE)|NODE_RANK|"
                        r"MASTER_(ADDR|PORT)|(CUDA|ROCR|HIP|NVIDIA)_VISIBLE_DEVICES|GPU_DEVICE_ORDINAL|"
                        r"ZE_AFFINITY_MASK|PYTHONPATH|SHLVL|OLDPWD|_")
RUNS_OWN = re.compile(r"SLIPWAY_\w*|PYTHONPATH")  # what of its own the host's node check brings: the run's code


def module_imports(code_dir: Path) -> list[str]:
    """The modules the trainer and common packages of the code snapshot import at module level
    (statements at the top, or under a top-level if/try), theirs excluded, in the order found."""
    found: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            found.extend(n for n in names if n and n.split(".")[0] not in OWN and n != "__future__" and n not in found)
            if isinstance(node, (ast.If, ast.Try)):
                for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", []))):
                    visit(block)

    for package in OWN:
        for path in sorted((code_dir / package).glob("*.py")):
            with contextlib.suppress(OSError, SyntaxError, ValueError):
                visit(ast.parse(path.read_text(), str(path)).body)
    return found


def _fork_unsafe() -> str:
    """Why forking this process now is unsafe ("" when it is not): a CUDA context, or a thread that
    outlives a fork (after a throwaway one: OpenBLAS, say, stops its pool for a fork)."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda") and torch.cuda.is_initialized():
        return "an import created a CUDA context"
    if (threads := len(os.listdir("/proc/self/task"))) > 1:
        if (probe := os.fork()) == 0:
            os._exit(0)
        os.waitpid(probe, 0)
        threads = len(os.listdir("/proc/self/task"))
    return f"an import started threads that outlive a fork ({threads} running): forking is unsafe" if threads > 1 else ""


def _import_all(names) -> None:
    for name in names:
        with contextlib.suppress(Exception):  # a module the image lacks is the rank's to report, cold
            __import__(name)
    for name in [m for m in sys.modules if m.split(".")[0] in OWN]:
        del sys.modules[name]  # a third party's import of ours: each rank imports the run's


def learn(names: set[str]) -> int:
    """Import what the ranks imported after the fork (torch's lazy imports: torch._dynamo, numpy
    for checkpoints...), so the next ranks start with them; first in a throwaway child, so that
    a module that would start a thread or a CUDA context is never imported here. How many came."""
    if not (names := {n for n in names if n not in sys.modules}):
        return 0
    if (probe := os.fork()) == 0:
        _import_all(sorted(names))
        os._exit(1 if _fork_unsafe() else 0)
    if os.waitstatus_to_exitcode(os.waitpid(probe, 0)[1]) != 0:
        return 0
    before = len(sys.modules)
    _import_all(sorted(names))
    return len(sys.modules) - before


def _stamp(files) -> dict[str, tuple]:
    """What says `files` are still those imported: each one's identity on disk."""
    out: dict[str, tuple] = {}
    for file in files:
        with contextlib.suppress(OSError):
            st = os.stat(file)
            out[file] = (st.st_ino, st.st_size, st.st_mtime_ns)
        out.setdefault(file, ())
    return out


def _shadowed(path: list[str]) -> str:
    """A module held that `path`, a rank's sys.path, would find elsewhere, said ("" if none); the warm
    process's own code is not the rank's to find."""
    from importlib.machinery import PathFinder

    for name, module in list(sys.modules.items()):
        spec, file = getattr(module, "__spec__", None), getattr(module, "__file__", None)
        if "." not in name and file and spec is not None and spec.name == name and spec.has_location and \
                f"{name}.py" not in CODE:
            if (found := PathFinder.find_spec(name, path)) is None or found.origin != file:
                return f"its sys.path finds {name} {f'at {found.origin}' if found else 'nowhere'}, not at {file}"
    return ""


def _pools(env: dict, cpus: int) -> int:
    """The thread count a library sizes its pool by at import: OMP_NUM_THREADS, at most the CPUs."""
    value = env.get("OMP_NUM_THREADS", "")
    return min(cpus, int(value)) if value.isdigit() and int(value) > 0 else cpus


def _request(message: dict, fds: list[int]) -> dict:
    """`message` if it is a request as clients send it (and its three streams came), else ValueError."""
    kinds = {"argv": list, "executable": str, "env": dict, "cwd": str, "cpus": list, "umask": int}
    words = [*message.get("argv", ()), *message.get("env", {}), *message.get("env", {}).values()]
    if len(fds) != 3 or any(not isinstance(message.get(k), kind) for k, kind in kinds.items()) or \
            not all(isinstance(w, str) for w in words) or {type(c) for c in message["cpus"]} - {int} or len(message["argv"]) < 2:
        raise ValueError("a request off the protocol")
    return message


class Warm:
    """The warm process's loop: one thread, selectors over its socket, the clients' connections, each
    forked rank's report channel (what it imported, said at its end) and a self-pipe for SIGCHLD and SIGTERM."""

    def __init__(self, listener: socket.socket, prefix: str, record: dict[str, str], lock: int):
        self.listener, self.prefix, self.record = listener, prefix, record  # record: the environment it started with
        self.lock = lock  # its name's, held while it listens
        self.secret, self.base_path = allocation_secret(prefix), _base_path(os.environ.get("PYTHONPATH", ""))
        self.stamp: dict[str, tuple] = {}
        self.restamp()
        self.ranks: dict[int, "socket.socket | None"] = {}  # pid -> its client's connection (None: gone)
        # A connection -> its challenge and deadline while unproven, then its rank's pid (0 before the
        # fork); a rank's report channel -> REPORT.
        self.conns: dict[socket.socket, "tuple[str, float] | int | str"] = {}
        self.learned: set[str] = set()
        self.draining = False
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "draining", True))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the run's, not ours
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")

    def serve(self, unsafe: str) -> "dict | None":
        while True:
            if self.draining and self.listener.fileno() >= 0:  # the name is free: a new warm process may take it
                self.sel.unregister(self.listener)
                for name in (".sock", ".lock"):
                    with contextlib.suppress(OSError):
                        os.unlink(f"{self.prefix}-{NODE}{name}")
                self.listener.close()
                os.close(self.lock)
            if not self.ranks and self.learned:
                came, self.learned = learn(self.learned), set()
                unsafe = unsafe or _fork_unsafe()
                self.restamp()
                if came:
                    say(f" learned {came} modules the ranks imported")
            if self.draining and not self.ranks:
                say(" stopped")
                return None
            for conn in [c for c, s in self.conns.items() if isinstance(s, tuple) and time.monotonic() > s[1]]:
                self.close(conn)
            for event, _ in self.sel.select(timeout=PROOF_SECONDS):
                if event.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 512)
                    self.reap()
                elif event.data == "listen":
                    with contextlib.suppress(OSError):
                        conn, _ = self.listener.accept()
                        self.conns[conn] = (secrets.token_hex(16), time.monotonic() + PROOF_SECONDS)
                        self.sel.register(conn, selectors.EVENT_READ, conn)
                        send(conn, {"challenge": self.conns[conn][0]})
                elif (rank := self.receive(event.data, unsafe)) is not None:
                    return rank

    def restamp(self) -> None:
        """Stamps for the files of the modules held and the sys.path folders (an install changes one)
        that have none: a module held keeps the stamp of its import, or a file changed since (while a
        rank ran, say) would pass for the one held."""
        modules = {f for f in (getattr(m, "__file__", None) for m in list(sys.modules.values())) if isinstance(f, str)}
        self.stamp = {**_stamp((modules | set(self.base_path)) - self.stamp.keys()), **self.stamp}
        self.shadow: tuple = ((), "")  # the last `_shadowed`: (the sys.path a request built, its folders' stamps), its answer

    def close(self, conn: socket.socket) -> None:
        if self.conns.pop(conn, None) is not None:
            self.sel.unregister(conn)
            conn.close()

    def receive(self, conn: socket.socket, unsafe: str) -> "dict | None":
        """A client's message: its proof, its request or a signal for its rank; or a rank's imports at
        its end, on its report channel. Anything else, or nothing (the client is gone: so is its rank,
        reaped later), ends that connection only."""
        fds, state = [], self.conns[conn]
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
            if not isinstance(message := json.loads(data) if data else None, dict):
                raise EOFError if not data else ValueError("a message that is no JSON object")
            if state == REPORT:
                if not isinstance(names := message.get("imported"), list):
                    raise ValueError("a report that is no list of modules")
                self.learned |= {name for name in names if isinstance(name, str)}
                self.close(conn)
            elif isinstance(state, tuple):
                if not hmac.compare_digest(str(message.get("answer")), mac(self.secret, state[0])):
                    raise ValueError("a client without this allocation's secret")
                self.conns[conn] = 0
                send(conn, {"answer": mac(self.secret, message.get("challenge"))})
            elif state:
                _kill(state, int(message["signal"]))
            else:
                request, streams, fds = _request(message, fds), fds, []  # fork() owns the streams now
                return self.fork(conn, request, streams, unsafe)
        except Exception as exc:  # noqa: BLE001 - whatever a client sends, the warm process serves on
            if not isinstance(exc, EOFError):
                say(f": a connection ended: {type(exc).__name__}: {exc}"[:300])
            if isinstance(state, int) and state:
                _kill(state, signal.SIGKILL)
                self.ranks[state] = None
            self.close(conn)
            for fd in fds:
                os.close(fd)
        return None

    def fork(self, conn: socket.socket, request: dict, fds: list[int], unsafe: str) -> "dict | None":
        """Fork the rank `request` asks for (the child returns it, with its streams), or answer why
        it starts cold."""
        if request.get("own") is True:  # slipway's node check from the host: as the warm process is, but the run's
            request.update(executable=os.path.realpath(sys.executable), cwd=os.getcwd(),
                           cpus=sorted(os.sched_getaffinity(0)),
                           env={**{k: v for k, v in self.record.items() if not RUNS_OWN.fullmatch(k)},
                                **{k: v for k, v in request["env"].items() if RUNS_OWN.fullmatch(k)}})
        request["path"] = _rank_path(request, self.base_path)
        request["set"] = {k: os.environ.get(k) for k in {*os.environ, *self.record} if os.environ.get(k) != self.record.get(k)}
        if why := unsafe or self.refusal(request):
            send(conn, {"cold": why})
            for fd in fds:
                os.close(fd)
            return self.close(conn)
        # The rank's own channel back, for what it imported: no proof to make at its end.
        report, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if (child := os.fork()) == 0:  # the rank: nothing of the loop's goes with it
            signal.set_wakeup_fd(-1)
            if self.listener.fileno() >= 0:  # a rank holds neither its socket nor its name
                self.listener.close()
                os.close(self.lock)
            for c in [*self.conns, report]:
                c.close()
            self.sel.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            return {**request, "fds": fds, "report": theirs}
        theirs.close()
        for fd in fds:
            os.close(fd)
        self.conns[report] = REPORT
        self.sel.register(report, selectors.EVENT_READ, report)
        self.conns[conn], self.ranks[child] = child, conn
        send(conn, {"pid": child})
        return None

    def refusal(self, request: dict) -> str:
        """Why this request starts cold, "" to fork it; a changed module retires the warm process."""
        argv, env, cpus = request["argv"], request["env"], len(request["cpus"])
        if request["executable"] != os.path.realpath(sys.executable):
            return f"its interpreter {request['executable']} is not the warm process's {sys.executable}"
        if (argv[1] == "-m" and len(argv) < 3) or (argv[1].startswith("-") and argv[1] != "-m"):
            return "its command is not `PYTHON -m MODULE ...` or `PYTHON SCRIPT ...`"
        if differ := sorted(k for k in {*env, *self.record} if env.get(k) != self.record.get(k) and not PER_LAUNCH.fullmatch(k)):
            return f"its environment differs from the warm process's in {', '.join(differ[:6])}{' ...' * (len(differ) > 6)}"
        if _pools(env, cpus) != _pools(env, len(os.sched_getaffinity(0))):
            return f"its {cpus} CPUs size the libraries' thread pools otherwise than the warm process's"
        if not os.path.isdir(request["cwd"]):
            return f"its working directory {request['cwd']} is not in the warm process's view"
        now = _stamp(self.stamp)
        if changed := next((f for f in now if now[f] != self.stamp[f]), None):
            self.draining = True
            return f"{changed} changed on disk since the warm process imported it; it stops"
        # The ranks of a launch build one sys.path: found once while no folder on it changes (the
        # import system's own rule: a finder lists a folder again once its mtime moved).
        if (key := tuple(_stamp(request["path"]).items())) != self.shadow[0]:
            self.shadow = key, _shadowed(request["path"])
        return self.shadow[1] or _fork_unsafe()

    def reap(self) -> None:
        with contextlib.suppress(ChildProcessError):
            while self.ranks and (ended := os.waitpid(-1, os.WNOHANG))[0]:
                pid, status = ended
                if (conn := self.ranks.pop(pid, None)) is not None:
                    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
                    with contextlib.suppress(OSError):
                        send(conn, {"exit": os.waitstatus_to_exitcode(status) if sig is None else 0, "signal": sig})
                    self.close(conn)


def _hold_secret(prefix: str) -> int:
    """The allocation's secret made, then held shared for this process's life (`_clear`)."""
    for _ in range(5):  # its last holder may remove it between the two
        allocation_secret(prefix, create=True)
        held = os.open(secret_path(prefix), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.flock(held, fcntl.LOCK_SH)
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(held).st_ino == os.lstat(secret_path(prefix)).st_ino:
                return held
        os.close(held)
    raise Cold("the allocation's secret was removed as soon as made")


def _clear(folder: Path, job: str, fd: int) -> None:
    """Allocation `job`'s files here gone where its secret (open as `fd`, then closed) can be held
    alone: no warm process of it lives on this node, as each holds it shared, and one starting waits
    for this, then makes a new secret before any file of its own. A warm process's end clears its
    own allocation's (its last one here), its start others' (left by those killed outright: SIGKILL
    at their allocation's end, the OOM killer)."""
    secret = folder / f"{job}.secret"
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino == secret.lstat().st_ino:
            for left in [*folder.glob(f"{glob.escape(job)}-*"), secret]:
                left.unlink(missing_ok=True)
    os.close(fd)


def serve(prefix: str, code_dir: Path) -> "dict | None":
    """Serve SOCKET until SIGTERM and no rank is left (None), or return in a forked child (its request)."""
    path, mine, held, lock = f"{prefix}-{NODE}.sock", Path(secret_path(prefix)), -1, -1
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(Path(prefix).parent, 0o700)
        allocation_secret(prefix, create=True)  # (the folder's owner and mode checked first)
        for other in mine.parent.glob("*.secret"):
            if other != mine and not other.name.startswith("."):
                with contextlib.suppress(OSError):
                    _clear(mine.parent, other.stem, os.open(other, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
        held = _hold_secret(prefix)
        lock = os.open(path[:-5] + ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held for life: one warm process per name
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by a warm process killed outright: the lock says none serves it
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(path)
    except (Cold, OSError) as exc:
        for fd in (lock, held):
            if fd >= 0:
                os.close(fd)
        return say(" already served" if isinstance(exc, BlockingIOError) else f" cannot serve: {exc}")
    listener.listen(64)
    say(" bound")
    record, started, before = dict(os.environ), time.monotonic(), len(sys.modules)
    _import_all(module_imports(code_dir))
    unsafe = _fork_unsafe()
    say(f" ready: {len(sys.modules) - before} modules in {time.monotonic() - started:.1f} s"
         f"{'; every rank starts cold: ' + unsafe if unsafe else ''}")
    if (rank := Warm(listener, prefix, record, lock).serve(unsafe)) is None:
        _clear(mine.parent, mine.stem, held)
    else:  # a rank holds no secret: the last warm process of the allocation removes it
        os.close(held)
    return rank


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, sig)


def _base_path(pythonpath: str) -> list[str]:
    """sys.path without PYTHONPATH's entries and the script's own directory: what every rank's
    sys.path ends with, after its own PYTHONPATH."""
    own = {os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p} | {os.path.dirname(os.path.abspath(__file__))}
    return [p for p in sys.path if p and os.path.abspath(p) not in own]


def _rank_path(request: dict, base: list[str]) -> list[str]:
    """sys.path as the request's command builds it: its first entry (none under PYTHONSAFEPATH),
    its PYTHONPATH, then the interpreter's own (`base`)."""
    argv, env, cwd = request["argv"], request["env"], request["cwd"]
    first = [] if env.get("PYTHONSAFEPATH") else \
        [cwd if argv[1] == "-m" else os.path.dirname(os.path.realpath(os.path.join(cwd, argv[1])))]
    return first + [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + base


def main(args: list[str]) -> int:
    if len(args) == 4 and args[0] == "serve" and args[2] == "--code":
        return 0 if (rank := serve(args[1], Path(args[3]))) is None else finish(rank)
    print("usage: warm.py serve SOCKET --code DIR (a rank's client: warm_rank.py)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
