"""Warm ranks: ranks started from a process that has already paid for the interpreter, torch and
the other heavy imports, with the run's own code imported fresh (`slipway run`, issue 41).

Run as a file, never imported as `trainer.warm`: a warm process holds no module of the trainer's
(nor of `common`), so that each run imports its own code snapshot.

    python3 .../trainer/warm.py serve NAME --code DIR    # one per node and allocation (a Slurm step)
    python3 -S .../trainer/warm.py rank NAME -- python3 -m trainer --config ...   # each rank's task

`serve` binds the abstract Unix socket NAME first (clients that come while it imports wait in
its backlog), imports what the code snapshot DIR imports at module level (never trainer/ nor
common/), then forks a rank for each request. `rank` hands its standard streams, environment,
working directory, CPU set and umask to the warm process, passes on the signals it gets, and exits
as its rank did; where no warm process answers (none, another key, a refusal) it execs the
command itself: the rank starts cold, as without warm processes.

Why the fork is safe: the warm process runs no torch operation, so it has no thread, OpenMP pool
or CUDA context (checked before every fork, else no fork). The rank gets the client's environment
whole, sys.path rebuilt from its PYTHONPATH, its own intra-op thread count (OpenMP read
OMP_NUM_THREADS at the warm process's import), `random` reseeded and the default signal handlers;
it then imports the run's code and builds its process group and model as a cold rank does. A
changed image, container settings or interpreter give another NAME (jobs/slurm/warm.py); torch
changed under a warm process (a venv reinstalled) is found at the next request, which starts cold
and ends that warm process. A rank is the warm process's child in a session of its own: a signal
its client gets goes to the rank's process group, and a client that dies (Slurm's SIGKILL) takes
its rank with it. The warm process is a step of the allocation: it ends with it, or on SIGTERM
(`slipway run --stop-warm`, another key started) once its ranks have ended.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

# The signals a client passes on to its rank (SIGKILL cannot be caught: the client's death is).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)
OWN = ("trainer", "common")  # slipway's packages: each rank imports the run's own
MAX_MESSAGE = 1 << 20  # a request: the environment, the command


def _node() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _peer_uid(sock: socket.socket) -> int:
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


# ---------------------------------------------------------------------------- the rank's task


def client(name: str, argv: list[str]) -> int:
    """Start `argv` as a rank through the warm process NAME, or cold (exec) where none answers."""
    why, sock, umask = "", None, os.umask(0o022)
    os.umask(umask)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect("\0" + name)
        if _peer_uid(sock) != os.getuid():  # another user's socket under our name: never tell it anything
            raise ConnectionRefusedError(f"the socket {name} is another user's")
        _send(sock, {"argv": argv, "executable": os.path.realpath(sys.executable), "env": dict(os.environ),
                     "cwd": os.getcwd(), "cpus": sorted(os.sched_getaffinity(0)), "umask": umask}, [0, 1, 2])
        reply = json.loads(sock.recv(MAX_MESSAGE) or b'{"cold": "the warm process ended"}')
        why = reply.get("cold", "")
    except (OSError, ValueError) as exc:
        why = "no warm process on this node" if isinstance(exc, (ConnectionRefusedError, FileNotFoundError)) \
            else f"the warm process did not answer ({exc})"
    if why or sock is None:
        if sock is not None:
            sock.close()
        print(f"slipway-warm {_node()}: rank {os.environ.get('RANK', '?')} starts cold: {why}", file=sys.stderr,
              flush=True)
        os.execvp(argv[0], argv)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _send(sock, {"signal": signum}))
    while True:
        try:
            data = sock.recv(MAX_MESSAGE)
        except InterruptedError:
            continue
        if not data:
            print(f"slipway-warm {_node()}: the warm process ended under rank {os.environ.get('RANK', '?')}",
                  file=sys.stderr, flush=True)
            return 1
        message = json.loads(data)
        if "exit" in message:
            code, sig = message["exit"], message.get("signal")
            return 128 + sig if sig else code


# ---------------------------------------------------------------------------- the warm process


def module_imports(code_dir: Path) -> list[str]:
    """The modules the trainer and common packages of the code snapshot import at module level
    (statements at the top, or under a top-level if/try), theirs excluded, in the order found."""
    found: list[str] = []

    def add(name: str) -> None:
        if name and name.split(".")[0] not in OWN and name != "__future__" and name not in found:
            found.append(name)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                add(node.module)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    for package in OWN:
        for path in sorted((code_dir / package).glob("*.py")):
            try:
                visit(ast.parse(path.read_text(), str(path)).body)
            except (OSError, SyntaxError, ValueError):
                continue
    return found


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def _torch_stamp() -> str:
    """What says torch is still the one imported: its files' sizes and times."""
    torch_file, out = getattr(sys.modules.get("torch"), "__file__", None), []
    for name in ("__init__.py", "version.py") if torch_file else ():
        with contextlib.suppress(OSError):
            st = (Path(torch_file).parent / name).stat()
            out.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return " ".join(out)


def _fork_unsafe() -> str:
    """Why forking this process now is unsafe ("" when it is not)."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda") and torch.cuda.is_initialized():
        return "an import created a CUDA context"
    threads = _threads()
    return f"an import started threads ({threads} running): forking is unsafe" if threads != 1 else ""


def _import_all(names) -> None:
    for name in names:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module the image lacks is the rank's to report, cold
            continue
    for name in [m for m in sys.modules if m.split(".")[0] in OWN]:
        del sys.modules[name]  # a third party's import of ours: each rank imports the run's


def learn(names: set[str]) -> int:
    """Import what the ranks imported after the fork (torch's lazy imports: torch._dynamo, numpy
    for checkpoints...), so the next ranks start with them; first in a throwaway child, so that
    a module that would start a thread or a CUDA context is never imported here. How many came."""
    names = {n for n in names if n not in sys.modules}
    if not names:
        return 0
    probe = os.fork()
    if probe == 0:
        _import_all(sorted(names))
        os._exit(0 if not _fork_unsafe() else 1)
    _, status = os.waitpid(probe, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return 0
    before = len(sys.modules)
    _import_all(sorted(names))
    return len(sys.modules) - before


class Rank:
    """A forked child's request: what it becomes once the warm process's loop has let it go."""

    def __init__(self, request: dict, fds: list[int], report: int):
        self.request, self.fds, self.report = request, fds, report  # report: where to say what it imported


class Warm:
    """The warm process's loop: one thread, selectors over its socket, the clients' connections,
    the ranks' reports of their imports and a self-pipe for SIGCHLD and SIGTERM."""

    def __init__(self, listener: socket.socket, key: str):
        self.listener, self.key, self.stamp = listener, key, _torch_stamp()
        self.base_path = _base_path(os.environ.get("PYTHONPATH", ""))
        self.ranks: dict[int, "socket.socket | None"] = {}  # pid -> its client's connection (None: gone)
        self.conns: dict[socket.socket, int] = {}  # connection -> its rank's pid (0 before the fork)
        self.reports: dict[int, bytes] = {}  # a rank's report pipe -> what it said so far
        self.learned: set[str] = set()
        self.draining = False
        self.wake_r, wake_w = os.pipe()
        for fd in (self.wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "draining", True))
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the run's, not ours
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")

    def serve(self, unsafe: str) -> "Rank | None":
        while True:
            if self.draining and self.listener.fileno() >= 0:
                self.sel.unregister(self.listener)
                self.listener.close()  # the name is free: a new warm process may take it
            if not self.ranks and self.learned:
                came = learn(self.learned)
                self.learned = set()
                if came:
                    print(f"slipway-warm {_node()} learned {came} modules the ranks imported", flush=True)
            if self.draining and not self.ranks:
                print(f"slipway-warm {_node()} stopped", flush=True)
                return None
            for event, _ in self.sel.select():
                what = event.data
                if what == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 512)
                    self.reap()
                elif what == "listen":
                    self.accept()
                elif isinstance(what, int):
                    self.read_report(what)
                else:
                    rank = self.receive(what, unsafe)
                    if rank is not None:
                        return rank

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if _peer_uid(conn) != os.getuid():
            conn.close()
            return
        self.conns[conn] = 0
        self.sel.register(conn, selectors.EVENT_READ, conn)

    def close(self, conn: socket.socket) -> None:
        if self.conns.pop(conn, None) is not None:
            self.sel.unregister(conn)
            conn.close()

    def read_report(self, fd: int) -> None:
        data = os.read(fd, 65536)
        if data and len(self.reports[fd]) < MAX_MESSAGE:
            self.reports[fd] += data
            return
        self.sel.unregister(fd)
        os.close(fd)
        self.learned |= set(self.reports.pop(fd).decode(errors="replace").split())

    def receive(self, conn: socket.socket, unsafe: str) -> "Rank | None":
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        except OSError:
            data, fds = b"", []
        pid = self.conns.get(conn, 0)
        if not data:  # the client is gone: so is its rank (reaped later)
            if pid:
                _kill(pid, signal.SIGKILL)
                self.ranks[pid] = None
            self.close(conn)
            return None
        message = json.loads(data)
        if pid:
            if "signal" in message:
                _kill(pid, int(message["signal"]))
            return None
        why = unsafe or _refusal(message, self.key, self.stamp)
        if why:
            _send(conn, {"cold": why})
            for fd in fds:
                os.close(fd)
            self.close(conn)
            self.draining |= why.startswith("torch changed")
            return None
        report_r, report_w = os.pipe()
        child = os.fork()
        if child == 0:  # the rank: nothing of the loop's goes with it
            signal.set_wakeup_fd(-1)
            for c in list(self.conns):
                c.close()
            self.sel.close()
            for fd in (self.wake_r, report_r, *self.reports):
                os.close(fd)
            if self.listener.fileno() >= 0:
                self.listener.close()
            message["base_path"] = self.base_path
            return Rank(message, fds, report_w)
        for fd in (*fds, report_w):
            os.close(fd)
        self.reports[report_r] = b""
        self.sel.register(report_r, selectors.EVENT_READ, report_r)
        self.conns[conn], self.ranks[child] = child, conn
        _send(conn, {"pid": child})
        return None

    def reap(self) -> None:
        while self.ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.ranks.pop(pid, None)
            if conn is None:
                continue
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            with contextlib.suppress(OSError):
                _send(conn, {"exit": os.waitstatus_to_exitcode(status) if sig is None else 0, "signal": sig})
            self.close(conn)


def serve(name: str, key: str, code_dir: Path) -> "Rank | None":
    """Serve NAME until SIGTERM and no rank is left (None), or return in a forked child (its Rank)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind("\0" + name)
    except OSError:
        print(f"slipway-warm {_node()} already served", flush=True)
        return None
    listener.listen(64)
    print(f"slipway-warm {_node()} bound", flush=True)
    started, before = time.monotonic(), len(sys.modules)
    _import_all(module_imports(code_dir))
    unsafe = _fork_unsafe()
    print(f"slipway-warm {_node()} ready: {len(sys.modules) - before} modules in {time.monotonic() - started:.1f} s"
          f"{'; every rank starts cold: ' + unsafe if unsafe else ''}", flush=True)
    return Warm(listener, key).serve(unsafe)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, sig)


def _refusal(message: dict, key: str, stamp: str) -> str:
    """Why this request starts cold, "" to fork it."""
    argv = message.get("argv") or []
    if message.get("executable") != os.path.realpath(sys.executable):
        return f"its interpreter {message.get('executable')} is not the warm process's {sys.executable}"
    if len(argv) < 2 or (argv[1] == "-m" and len(argv) < 3) or (argv[1].startswith("-") and argv[1] != "-m"):
        return "its command is not `PYTHON -m MODULE ...` or `PYTHON SCRIPT ...`"
    if message.get("env", {}).get("SLIPWAY_WARM_ID", key) != key:
        return "another key"
    if _torch_stamp() != stamp:
        return "torch changed under the warm process; it stops"
    if not os.path.isdir(message.get("cwd", "")):
        return f"its working directory {message.get('cwd')} is not in the warm process's view"
    return _fork_unsafe()


def _base_path(pythonpath: str) -> list[str]:
    """sys.path without PYTHONPATH's entries and the script's own directory: what every rank's
    sys.path ends with, after its own PYTHONPATH."""
    own = {os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p}
    here = os.path.dirname(os.path.abspath(__file__))
    return [p for p in sys.path if p and os.path.abspath(p) not in own and os.path.abspath(p) != here]


def run_rank(rank: Rank) -> None:
    """In the forked child: become the rank the request describes, as `python -m MODULE` or
    `python SCRIPT` would start it, then run it (its SystemExit is this process's exit)."""
    import importlib
    import runpy

    req = rank.request
    os.setsid()
    for target, fd in enumerate(rank.fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    for sig in (signal.SIGCHLD, signal.SIGTERM, *FORWARDED):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.umask(int(req.get("umask", 0o022)))
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    argv = req["argv"]
    module = argv[2] if argv[1] == "-m" else None
    own = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = [] if os.environ.get("PYTHONSAFEPATH") else [os.getcwd() if module else os.path.dirname(argv[1])]
    sys.path[:] = first + own + req["base_path"]
    importlib.invalidate_caches()
    with contextlib.suppress(OSError, KeyError, ValueError):
        os.sched_setaffinity(0, req["cpus"])
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # OpenMP read the variable at the warm process's import
    if "random" in sys.modules:
        sys.modules["random"].seed()  # as a fresh interpreter seeds it
    sys.stdout.flush()
    sys.stderr.flush()
    if module:
        sys.argv = [argv[0], *argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")


def finish(rank: Rank) -> int:
    """Run the rank and end this process as a fork child ends (multiprocessing's way): its threads
    joined and its atexit functions run as at any exit, then os._exit, without tearing down the
    thousands of modules it shares with the warm process page by page (seconds on a loaded node)."""
    import atexit
    import threading
    import traceback

    code, forked_with = 0, set(sys.modules)
    try:
        run_rank(rank)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would report it
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        _report(rank.report, forked_with)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _report(fd: int, forked_with: set[str]) -> None:
    """Tell the warm process what this rank imported from where it imports too (not the run's own
    code: trainer/, common/, anything on the rank's PYTHONPATH), for the next ranks (`learn`)."""
    own = tuple(os.path.abspath(p) + os.sep for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    names = []
    for name in set(sys.modules) - forked_with:
        file = getattr(sys.modules.get(name), "__file__", None) or ""
        if name.split(".")[0] not in OWN and not (own and os.path.abspath(file).startswith(own)):
            names.append(name)
    with contextlib.suppress(OSError):
        with os.fdopen(fd, "w") as out:
            out.write("\n".join(sorted(names)))


def main(args: list[str]) -> int:
    if len(args) >= 3 and args[0] == "rank" and "--" in args:
        return client(args[1], args[args.index("--") + 1:])
    if len(args) == 4 and args[0] == "serve" and args[2] == "--code":
        rank = serve(args[1], os.environ.get("SLIPWAY_WARM_ID", ""), Path(args[3]))
        if rank is None:
            return 0
        return finish(rank)
    print("usage: warm.py serve NAME --code DIR | warm.py rank NAME -- PYTHON (-m MODULE | SCRIPT) ARGS...",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
