"""The worker's rank fork server (`python -m sdq.workers.train.ranks.server`, started by
forks.py): it imports torch and the rank's work once, then forks each rank the worker asks
for, with those imports done. A rank starts in a fraction of a second instead of the
seconds they take (6.8 s of CPU on two busy cores), however many runs the worker trains.

Requests come on its standard input, a datagram socket from the worker: the job's folder,
the rank's log and environment, with the rank's end of the pipe that announces its jobs. It
replies with the rank's process id and a pidfd of it, and says how each rank ended.

It dies with the worker: the parent-death signal is armed before anything else, so a worker
killed while the server imports leaves nothing behind (armed after the imports, as rank
processes once did, one lived on for the 79 s they took with nobody to stop it); should the
worker die before it is armed, the server ends at its input's end. Its ranks, armed against
the server in turn, die with it. The imports are loaded for good (sdq.models.loading), in
the server and so in every rank: left to the collector, they cost a rank 1-1.3 s of
collections as it started, and a run 0.25-0.3 s of a full collection on one rank mid-run,
the other ranks waiting for it at their next collective."""

import ctypes
import json
import os
import selectors
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NoReturn

# Light on purpose: the parent-death signal is armed once these are imported.
from sdq.models.loading import loaded_for_good

Serve = Callable[[Path, BinaryIO], NoReturn]
MESSAGE_BYTES = 1 << 20  # the largest message: a request, with the worker's environment
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def main() -> NoReturn:
    """The server's life: dying with the worker, named, its imports done, then serving."""
    die_with_parent()
    name_process("sdq-rank-server")
    # torch.cuda.is_available() run by an import asks NVML, which a fork survives, instead of
    # starting CUDA, which it does not: each rank forked from here starts CUDA of its own.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    serve_forks(socket.socket(fileno=sys.stdin.fileno()), load())


def serve_forks(worker: socket.socket, serve: Serve) -> NoReturn:
    """Forks a rank for each request, says how each ended, and ends with its input."""
    ranks = selectors.DefaultSelector()
    ranks.register(worker, selectors.EVENT_READ)
    while True:
        for key, _ in ranks.select():
            if key.fileobj is worker:
                data, fds, _, _ = socket.recv_fds(worker, MESSAGE_BYTES, 1)
                if not data:
                    os._exit(0)  # the worker let it go, or died
                pid = fork_rank(json.loads(data), fds[0], serve, worker, ranks)
                pidfd = os.pidfd_open(pid)  # before it is reaped: it cannot be another's
                ranks.register(pidfd, selectors.EVENT_READ, pid)
                socket.send_fds(worker, [json.dumps({"started": pid}).encode()], [pidfd])
            else:
                ranks.unregister(key.fileobj)
                os.close(key.fileobj)
                _, status = os.waitpid(key.data, 0)
                ended = {"ended": key.data, "code": os.waitstatus_to_exitcode(status)}
                worker.send(json.dumps(ended).encode())


def load() -> Serve:
    """The rank's work, torch and all, loaded for good."""
    with loaded_for_good():
        from sdq.workers.train.ranks.serve import main
    return main


def fork_rank(
    request: dict,
    announced: int,
    serve: Serve,
    worker: socket.socket,
    ranks: selectors.BaseSelector,
) -> int:
    """The rank's process id; in the rank, its life (which never returns here)."""
    server = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(announced)
        return pid
    try:
        for key in list(ranks.get_map().values()):  # the server's: the channel, other ranks
            if key.fileobj is not worker:
                os.close(key.fileobj)
        ranks.close()
        run_rank(request, announced, serve, server, worker.detach())
    finally:
        os._exit(1)


def run_rank(request: dict, announced: int, serve: Serve, server: int, channel: int) -> NoReturn:
    """A rank: it dies with the server, writes its output to its log in the job's folder,
    takes the worker's environment as the worker had it when it asked for the rank (the
    server's is the worker's when the server started), then serves the run (serve.py)."""
    die_with_parent()
    if os.getppid() != server:
        os._exit(1)  # the server died before the signal was armed: so did the worker
    environment = request["environment"]
    local = environment["LOCAL_RANK"]
    name_process(f"sdq-rank{local}")
    with open(request["log"], "ab") as output, open(os.devnull, "rb") as nothing:
        os.dup2(nothing.fileno(), channel)  # the server's channel is not the rank's input
        os.dup2(output.fileno(), sys.stdout.fileno())
        os.dup2(output.fileno(), sys.stderr.fileno())
    os.environ.clear()
    os.environ.update(environment)
    serve(Path(request["folder"]), os.fdopen(announced, "rb", buffering=0))


def die_with_parent() -> None:
    """The kernel kills this process as soon as the one that started it dies, whatever
    killed that one (a SIGKILL, the task's hard time limit)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def name_process(name: str) -> None:
    """The name `ps`, `top` and `pgrep` show (the kernel keeps 15 bytes of it)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15])


if __name__ == "__main__":
    main()
