"""`sdq` commands as a user runs them, each in a process of its own, without paying for the
libraries' imports each time.

An embedded command imports torch, diffusers, transformers and the rest before it does
anything: ~8 s of CPU per command, which was most of what the suite's hundreds of commands
cost. This module, run as a program, imports those libraries once and then forks a child
per request: a process of its own (its own pid, session, environment, working folder and
standard streams, its exit code or the signal that ended it), which runs
`python -m sdq.producer.cli ARGS` in it. sdq's command line is imported before the fork
too (~0.2 s of CPU a command), but nothing of it runs: no setting is read, no cache filled.
That holds while importing it reads no environment variable, which preload() checks: it
refuses to start, failing every command, on the first sdq module that does.

What a library reads from the environment as it loads comes from the tests' environment,
not the command's: the verbosity of transformers and diffusers (set here as sdq's entry
points set it, so `--verbose` shows no more of theirs), OpenMP's and BLAS's thread counts
(sdq sets torch's threads itself), locale and warning filters. Commands where those, or
imports and start-up, are what a test looks at run as plain subprocesses."""

import atexit
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, MutableMapping
from contextlib import suppress
from pathlib import Path
from typing import IO, Any, NoReturn
from unittest.mock import patch

# The project root: where `python -m tests.preloaded` starts, and the tests' default folder.
ROOT = Path(__file__).resolve().parents[1]
COMMAND_MODULE = "sdq.producer.cli"
# What `sdq` imports before it runs a command: its commands and options.
COMMAND_LINE = "sdq.producer.cli.main"
STDLIB = sys.stdlib_module_names
# What an embedded command imports that costs seconds; each only imported, never used: a
# fork after torch has run an op with threads would leave the child's thread pool broken.
LIBRARIES = (
    "numpy", "PIL.Image", "torch", "diffusers", "transformers", "peft", "safetensors.torch",
    "pyarrow.parquet", "sqlalchemy.dialects.postgresql", "sqlalchemy.dialects.sqlite",
    "psycopg", "celery", "kombu", "redis", "boto3", "rich.console", "click", "faiss",
)  # fmt: skip
# The classes diffusers and transformers import lazily, on first use: most of their cost.
LAZY_NAMES = {
    "diffusers": ("AutoPipelineForText2Image", "StableDiffusionPipeline", "UNet2DConditionModel",
                  "AutoencoderKL", "StableDiffusionXLPipeline"),
    "transformers": ("CLIPModel", "CLIPTextModel", "CLIPTextModelWithProjection",
                     "CLIPTokenizer", "CLIPImageProcessor"),
}  # fmt: skip
REQUEST_BYTES = 1 << 20
POLL_SECONDS = 0.02


# -- the preloaded process -------------------------------------------------------------------


def preload() -> None:
    # As sdq's entry points do (workers/app.py::quiet_libraries): set before transformers
    # reads them, at import.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    for name in LIBRARIES:
        importlib.import_module(name)
    for module, names in LAZY_NAMES.items():
        for name in names:
            getattr(sys.modules[module], name)
    with patch.object(os, "environ", _ReadsBySdq(os.environ)) as watched:
        importlib.import_module(COMMAND_LINE)
    if watched.read:
        raise RuntimeError(
            f"importing {COMMAND_LINE} read {sorted(watched.read)} from the environment: a "
            "command forked after it would see the tests' own"
        )


class _ReadsBySdq(MutableMapping):
    """os.environ, noting each variable an sdq module reads or writes (what the libraries
    it imports read is theirs, as with LIBRARIES)."""

    def __init__(self, environment: MutableMapping[str, str]) -> None:
        self.environment, self.read = environment, set()

    def _note(self, name: str) -> None:
        """Notes a variable that code of an sdq module reads, directly or through the
        standard library (os.getenv, Path.home, ...); a read made as a module is imported
        (an importlib frame comes first) is that module's."""
        caller = sys._getframe(2)
        while (module := caller.f_globals.get("__name__", "")).partition(".")[0] in STDLIB:
            if module.startswith("importlib"):
                return
            caller = caller.f_back
        if module.startswith("sdq."):
            self.read.add(name)

    def copy(self) -> dict[str, str]:
        self._note("(every variable)")
        return dict(self.environment)

    def __getitem__(self, name: str) -> str:
        self._note(name)
        return self.environment[name]

    def __setitem__(self, name: str, value: str) -> None:
        self._note(name)
        self.environment[name] = value

    def __delitem__(self, name: str) -> None:
        self._note(name)
        del self.environment[name]

    def __iter__(self) -> Iterator[str]:
        self._note("(every variable)")
        return iter(self.environment)

    def __len__(self) -> int:
        return len(self.environment)


def serve(path: str) -> None:
    """Forks a command per connection and tells each client its command's pid, then its
    exit code; ends when the process that started it does."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], POLL_SECONDS)
        if readable:
            connection, _ = listener.accept()
            if (received := _receive(connection)) is not None:
                pid = _fork_command(*received, held=[connection, listener, *waiting.values()])
                waiting[pid] = connection
                # A client gone (a test interrupted) is no reason to stop serving the others.
                with suppress(OSError):
                    connection.send(json.dumps({"pid": pid}).encode())
        _report_ended(waiting)


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """A request and its three standard streams; None from a client gone before it asked."""
    with suppress(OSError, ValueError):
        message, fds, _, _ = socket.recv_fds(connection, REQUEST_BYTES, 3)
        if len(fds) == 3:
            return json.loads(message), fds
        for fd in fds:
            os.close(fd)
    connection.close()
    return None


def _fork_command(request: dict[str, Any], fds: list[int], held: list[socket.socket]) -> int:
    """Forks the request's command; the child keeps none of this process's sockets (a
    client's connection held open by another's command would never see it close)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for sock in held:
            sock.close()
        _run_command(request, fds)
    for fd in fds:
        os.close(fd)
    return pid


def _report_ended(waiting: dict[int, socket.socket]) -> None:
    for pid in list(waiting):
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            with waiting.pop(pid) as connection, suppress(OSError):
                connection.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())


def _run_command(request: dict[str, Any], fds: list[int]) -> NoReturn:
    """In the child: what `python -m sdq.producer.cli ARGS` would be, started with the
    request's environment, folder and standard streams, in a session of its own. It ends
    as that process would: through the interpreter's own exit (threads joined, exit
    handlers run, files flushed; an uncaught exception's traceback and code, an uncaught
    Ctrl-C's signal), never back into this process's loop."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:1] = [os.getcwd(), *extra]
    sys.argv = [COMMAND_MODULE, *request["args"]]
    runpy.run_module(COMMAND_MODULE, run_name="__main__", alter_sys=True)
    sys.exit(0)


# -- the tests' side -------------------------------------------------------------------------


class Preloaded:
    """The preloaded process of this test process, and the commands it runs."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="sdq-preloaded-"))
        self.path = str(self.folder / "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.preloaded", self.path],
            cwd=ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        said = self.process.stdout.readline()
        if said != b"ready\n":
            self.process.kill()
            raise RuntimeError(f"the preloaded process said {said!r}, exit {self.process.wait()}")
        atexit.register(self.stop)

    def run(
        self, args: list[str], *, env: dict[str, str], cwd: Path, timeout: float | None
    ) -> subprocess.CompletedProcess[str]:
        """As subprocess.run([python, -m, sdq.producer.cli, *args], capture_output=True,
        text=True, ...) would (its standard input empty)."""
        with open(os.devnull, "rb") as stdin, tempfile.TemporaryFile() as stdout, \
                tempfile.TemporaryFile() as stderr:  # fmt: skip
            code = self._wait(args, env, cwd, timeout, (stdin, stdout, stderr))
            output, errors = (_text(stream) for stream in (stdout, stderr))
        if code is None:
            raise subprocess.TimeoutExpired(args, timeout, output, errors)
        return subprocess.CompletedProcess(args, code, output, errors)

    def _wait(
        self, args: list[str], env: dict[str, str], cwd: Path, timeout: float | None,
        streams: tuple[IO[bytes], ...],
    ) -> int | None:  # fmt: skip
        request = {"args": list(args), "env": env, "cwd": str(Path(cwd).resolve())}
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.connect(self.path)
            socket.send_fds(connection, [json.dumps(request).encode()],
                            [stream.fileno() for stream in streams])  # fmt: skip
            pid = json.loads(connection.recv(REQUEST_BYTES))["pid"]
            connection.settimeout(timeout)
            try:
                return json.loads(connection.recv(REQUEST_BYTES))["exit"]
            except TimeoutError:
                _kill_group(pid)
                connection.settimeout(None)
                connection.recv(REQUEST_BYTES)
                return None
            except BaseException:
                # As subprocess.run does: an interrupted wait leaves no command running.
                _kill_group(pid)
                raise

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _kill_group(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _text(stream: IO[bytes]) -> str:
    """As subprocess's text mode reads a stream: universal newlines."""
    stream.seek(0)
    return stream.read().decode().replace("\r\n", "\n").replace("\r", "\n")


_running: list[Preloaded] = []


def preloaded() -> Preloaded:
    """This test process's preloaded process, started again if it has ended."""
    if not _running or _running[0].process.poll() is not None:
        _running[:] = [Preloaded()]
    return _running[0]


if __name__ == "__main__":
    preload()
    serve(sys.argv[1])
