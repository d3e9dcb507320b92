"""`python manage.py ...` without the second each one spends starting Django: a process that has
started it once (the zygote) forks a copy for each command. tests/test_docs_commands.py types
some sixty of them; cold, their starts were most of what that test cost.

A copy runs manage.py as `python manage.py ARGS` would: the same argv, directory, environment
and settings file, the command's own stdin, stdout and stderr; the command ends as the copy
does (its exit status, or the signal that killed it), and a signal sent to the command goes to
the copy. Whatever differs from what the zygote started with (an environment of its own, another
directory, the settings file changed, Python options) runs cold, as typed.

    python tests/warm_manage.py serve SOCKET                       # the zygote, in the world's env
    python -I -S tests/warm_manage.py client SOCKET PYTHON ARGS...  # what `python` runs

Only the standard library at the top: the client is on every command's path.
"""

import contextlib
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What a shell sets for each command it starts: not a difference between two commands (a
#: copy has the values of its own).
SHELL_NOISE = {"PWD", "OLDPWD", "SHLVL", "_"}


def environment(env) -> dict:
    return {k: v for k, v in env.items() if k not in SHELL_NOISE}


def client(path: str, python: str, args: list[str]) -> None:
    def cold():
        os.execv(python, [python, *args])

    if not args or args[0] != "manage.py" or not os.path.exists(path):
        cold()
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(path)
        request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    except OSError:  # no zygote, or a standard stream closed
        cold()
    reply = conn.recv(64)
    if reply in (b"", b"cold"):
        cold()
    pid = int(reply)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, lambda number, _: os.kill(pid, number))
    while True:
        try:
            kind, number = conn.recv(64).split()
            break
        except InterruptedError:
            continue
        except ValueError:  # the zygote went away mid-command
            sys.exit("warm_manage: the zygote went away")
    if kind == b"signal":  # killed by it: so is the client, for its shell to see
        if int(number) not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(int(number), signal.SIG_DFL)
        os.kill(os.getpid(), int(number))
    os._exit(int(number))


def serve(path: str) -> None:
    base = environment(os.environ)
    sys.path[0] = str(ROOT)  # as `python manage.py` has it, not tests/
    from controlplane import devenv

    devenv.load()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    settings_file = _read(devenv.path())
    import django
    from django.core.management import get_commands, load_command_class
    from django.db import connections

    django.setup()
    for name, app in get_commands().items():
        # Imported here, so that a copy's command is a dict look-up; one that fails to import
        # fails in the copy that runs it, as cold.
        with contextlib.suppress(Exception):
            load_command_class(app, name)
    connections.close_all()
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # connectable once it exists
    # The monitors reaped as they end (waited for: their CPU time counts as the test's).
    signal.signal(signal.SIGCHLD, _reap)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                _monitor(conn, base, settings_file)
            finally:
                os._exit(0)
        conn.close()


def _reap(*_) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _monitor(conn: socket.socket, base: dict, settings_file: str | None) -> None:
    """Start the copy, tell the client its pid, and report how it ended; kill it if the
    client goes (killed: the command with it)."""
    from controlplane import devenv

    message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    request = json.loads(message)
    if (
        len(fds) != 3
        or environment(request["env"]) != base
        or request["cwd"] != os.getcwd()
        or _read(devenv.path()) != settings_file
    ):
        conn.send(b"cold")
        return
    pid = os.fork()
    if pid == 0:
        conn.close()
        _command(request, fds)
    for fd in fds:
        os.close(fd)
    conn.send(str(pid).encode())
    child = os.pidfd_open(pid)
    ready, _, _ = select.select([conn, child], [], [])
    if child not in ready:  # the client is gone
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        conn.send(f"signal {os.WTERMSIG(status)}".encode())
    else:
        conn.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())


def _command(request: dict, fds: list[int]) -> None:
    """The copy: manage.py run as the client would have run it; never returns."""
    import atexit
    import runpy
    import traceback

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])  # manage.py reads the settings file again, as cold
    sys.argv = request["argv"]
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")  # manage.py, in the cwd
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"): printed, status 1, as the interpreter does
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # the traceback and status 1, as the interpreter does
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reader that closed the pipe
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    role, path, *rest = sys.argv[1:]
    if role == "serve":
        serve(path)
    else:
        client(path, rest[0], rest[1:])
