"""Warm ranks, a rank's side (trainer/warm.py is the warm process): the protocol both sides speak,
each rank's task (the client) and the rank the warm process forks (`finish`).

    python3 -S .../trainer/warm_rank.py rank SOCKET -- python3 -m trainer --config ...   # each rank's task
    python3 -S .../trainer/warm_rank.py node SOCKET -- python3 -m trainer.preflight node ...  # from the host

A client is on the way to every rank's start: it imports only what it uses. `node` is the
preflight's node check asked from the host (jobs/slurm/verify_lib.sh): no container is entered for
it, and it runs as the warm process is (its environment, directory and CPUs) with the run's code
(warm.py's RUNS_OWN); where the warm process does not take it, the batch script's node step does.
In a warm process, warm.py imports this file from its folder as `warm_rank`, never as a module of
the trainer package (a warm process holds none of trainer/ nor common/).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import signal
import socket
import stat
import sys

# The signals a client passes on to its rank (SIGKILL cannot be caught: the client's death is).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)
OWN = ("trainer", "common")  # slipway's packages: each rank imports the run's own
MAX_MESSAGE = 1 << 20  # a request: the environment, the command
# The warm process's own code, side by side in trainer/: its key (jobs/slurm/warm.py) hashes them
# all, and a rank's sys.path need not find them (warm.py's `_shadowed`).
CODE = ("warm.py", "warm_rank.py")
NODE = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
NOT_WARM = 3  # `warm_rank.py node`'s exit where no warm process ran the check


class Cold(Exception):
    """Why a rank starts cold."""


def say(text: str, stream=None) -> None:
    print(f"slipway-warm {NODE}{text}", file=stream or sys.stdout, flush=True)


def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def recv(sock: socket.socket) -> dict:
    """The next message ({} once the other side is gone); ValueError for one off the protocol."""
    message = json.loads(data) if (data := sock.recv(MAX_MESSAGE)) else {}
    if not isinstance(message, dict):
        raise ValueError("a message that is no JSON object")
    return message


def mac(secret: bytes, challenge: object) -> str:
    return hmac.new(secret, str(challenge).encode(), "sha256").hexdigest()


def secret_path(prefix: str) -> str:
    return os.path.join(os.path.dirname(prefix), f"{os.environ.get('SLURM_JOB_ID') or 'none'}.secret")


def allocation_secret(prefix: str, create: bool = False) -> bytes:
    """This allocation's secret, in SOCKET's folder, which must be this user's alone; made once,
    whole under another name, then linked (never seen half made, whoever is first)."""
    folder, path = os.path.dirname(prefix), secret_path(prefix)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise Cold(f"{folder} is not a folder of this user's closed to others: not a warm process's")
    tmp = os.path.join(folder, f".{os.getpid()}.secret")
    if create and not os.path.exists(path):
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
            f.write(os.urandom(32))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        os.unlink(tmp)
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
            st, data = os.fstat(f.fileno()), f.read(64)
    except OSError as exc:
        raise Cold(f"no secret of this allocation's ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or len(data) != 32:
        raise Cold(f"{path} is no secret of this user's")
    return data


# ---------------------------------------------------------------------------- the rank's task


def connect(prefix: str) -> socket.socket:
    """A connection to this node's warm process of SOCKET `prefix`, each side proven to the other."""
    secret, sock = allocation_secret(prefix), socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(f"{prefix}-{NODE}.sock")
        mine = os.urandom(16).hex()
        send(sock, {"answer": mac(secret, recv(sock).get("challenge")), "challenge": mine})
        if not hmac.compare_digest(str(recv(sock).get("answer")), mac(secret, mine)):
            raise Cold("the process on the warm socket did not prove this allocation's secret")
    except BaseException:
        sock.close()
        raise
    return sock


def client(prefix: str, argv: list[str], own: bool = False) -> int:
    """Start `argv` as a rank through this node's warm process, or cold (exec) where none takes it;
    one line on stderr says which (`slipway run` tells it on the terminal and in events.log).
    `own`: slipway's node check, run from the host in the warm process's own environment (the
    rank's would be the host's, not the container's), never cold here: NOT_WARM says it was not."""
    what, umask = f"rank {os.environ['RANK']}" if "RANK" in os.environ else "the node step", os.umask(0o022)
    os.umask(umask)
    try:
        sock = connect(prefix)
        send(sock, {"argv": argv, "executable": os.path.realpath(sys.executable), "env": dict(os.environ),
                     "cwd": os.getcwd(), "cpus": sorted(os.sched_getaffinity(0)), "umask": umask, "own": own},
             [0, 1, 2])
        if "pid" not in (reply := recv(sock)):  # (sockets close at exec)
            raise Cold(str(reply.get("cold") or "the warm process closed the connection"))
    except (Cold, OSError, ValueError) as exc:
        why = "no warm process on this node" if isinstance(exc, (FileNotFoundError, ConnectionRefusedError)) else \
            str(exc) if isinstance(exc, Cold) else f"the warm process did not answer ({exc})"
        if own:
            say(f": {what} runs in a step of its own: {why}", sys.stderr)
            return NOT_WARM
        say(f": {what} starts cold: {why}", sys.stderr)
        os.execvp(argv[0], argv)
    say(f": {what} started warm (pid {reply['pid']}{', asked from the host' if own else ''})", sys.stderr)
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: send(sock, {"signal": signum}))
    while True:  # (a signal's handler returns: recv goes on, PEP 475)
        try:
            message = recv(sock)
        except (OSError, ValueError):
            message = {}
        if "exit" in message:
            return 128 + message["signal"] if message.get("signal") else message["exit"]
        if not message:
            say(f": the warm process ended under {what}", sys.stderr)
            return 1


# ---------------------------------------------------------------------------- the forked rank


def run_rank(req: dict) -> None:
    """In the forked child: become the rank `req` describes, as `python -m MODULE` or `python
    SCRIPT` would start it, then run it (its SystemExit is this process's exit)."""
    import builtins
    import importlib.machinery
    import runpy
    import types

    argv = req["argv"]
    os.setsid()
    for target, fd in enumerate(req["fds"]):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    for sig in (signal.SIGCHLD, signal.SIGTERM, *FORWARDED):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.umask(req["umask"])
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for key, value in req["set"].items():  # what the imports held set in the environment (setdefault...)
        os.environ.pop(key, None) if value is None else os.environ.update({key: value})
    sys.path[:] = req["path"]
    importlib.invalidate_caches()
    with contextlib.suppress(OSError, ValueError):
        os.sched_setaffinity(0, req["cpus"])
    for generator in (sys.modules.get("numpy.random"), getattr(sys.modules.get("torch"), "default_generator", None)):
        getattr(generator, "seed", lambda: None)()  # from fresh entropy, as at their import in a cold rank
    main, warm_main = types.ModuleType("__main__"), sys.modules["__main__"]
    for name in [n for n, m in sys.modules.items() if m is warm_main]:  # multiprocessing's __mp_main__ too
        sys.modules[name] = main
    sys.stdout.flush()
    sys.stderr.flush()
    if argv[1] == "-m":
        sys.argv = [argv[0], *argv[3:]]
        runpy._run_module_as_main(argv[2])  # `python -m`'s own: in __main__'s namespace, with its errors
    else:
        sys.argv = argv[1:]
        main.__dict__.update(__file__=argv[1], __cached__=None, __builtins__=builtins,
                             __loader__=importlib.machinery.SourceFileLoader("__main__", argv[1]))
        with open(argv[1], "rb") as source:
            code = compile(source.read(), argv[1], "exec")
        exec(code, main.__dict__)


def finish(req: dict) -> int:
    """Run the rank and end this process as a fork child ends (multiprocessing's way): its threads
    joined and its atexit functions run as at any exit, then os._exit, without tearing down the
    thousands of modules it shares with the warm process page by page (seconds on a loaded node);
    then tell the warm process what it imported (not the run's own code: trainer/, common/, its
    PYTHONPATH), for the next ranks (`learn`), on the channel made with the fork."""
    import atexit
    import threading
    import traceback

    code, forked_with = 0, set(sys.modules)
    try:
        run_rank(req)
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
        own = tuple(os.path.abspath(p) + os.sep for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
        names = [name for name in set(sys.modules) - forked_with if name.split(".")[0] not in OWN and not (
            own and os.path.abspath(getattr(sys.modules.get(name), "__file__", None) or "").startswith(own))]
        with contextlib.suppress(OSError, ValueError):
            send(req["report"], {"imported": names})
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] in ("rank", "node") and sys.argv[3] == "--":
        sys.exit(client(sys.argv[2], sys.argv[4:], own=sys.argv[1] == "node"))
    print("usage: warm_rank.py rank|node SOCKET -- PYTHON (-m MODULE | SCRIPT) ARGS...", file=sys.stderr)
    sys.exit(2)
