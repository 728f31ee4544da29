"""The worker's side of its rank fork server (server.py): the server started once, before a
run needs it (rank_server), the ranks of each run forked from it, and a handle on each rank. The
server says when it has forked a rank (with a pidfd of it, which no other process can come
to stand for) and how each one ended. No torch here."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sdq.workers.train.ranks import server

WATCH_SECONDS = 1.0  # how often a worker waiting on its ranks calls its watch


class RankFailed(Exception):
    """A rank of the job's group died or failed (or could not be started): the job fails,
    and goes on from its last checkpoint when it is sent again."""


class RankServer:
    """The server process, and the worker's end of the channel to it (a datagram socket
    pair: one message per request or reply, file descriptors passed beside them)."""

    def __init__(self) -> None:
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:  # its standard input; its output is the worker's
            self.process = subprocess.Popen([sys.executable, "-m", server.__name__], stdin=theirs)
        self.codes: dict[int, int] = {}  # how each rank ended, by process id
        self.gone = False

    def fork(
        self, folder: Path, log: Path, environment: dict[str, str], watch: Callable[[], None]
    ) -> "Rank":
        """A rank for the job in `folder`, with that environment, its output in `log`: once
        the server has done its imports, if it is still doing them. `watch` is called about
        once a second meanwhile (a gang's member is seen alive so); should it raise, the
        server is stopped, and the rank with it."""
        announced, announcing = os.pipe()
        try:
            request = {"folder": str(folder), "log": str(log), "environment": environment}
            socket.send_fds(self.channel, [json.dumps(request).encode()], [announced])
        except OSError as error:  # it died since the worker last looked
            os.close(announcing)
            raise RankFailed(f"the rank fork server is gone: {error}") from error
        finally:
            os.close(announced)  # the rank's end: the worker holds only its own
        try:
            pid, pidfd = self._started(watch)
        except BaseException:
            os.close(announcing)
            self.stop()
            raise
        return Rank(pid, pidfd, os.fdopen(announcing, "wb", buffering=0), self)

    def _started(self, watch: Callable[[], None]) -> tuple[int, int]:
        """The process id and a pidfd of the rank just asked for."""
        while True:
            if not select.select([self.channel], [], [], WATCH_SECONDS)[0]:
                watch()
                continue
            message, fds = self._receive()
            if message is None:
                raise RankFailed(f"the rank fork server ended (code {self.process.wait()})")
            if "started" in message:
                return message["started"], fds[0]

    def code(self, pid: int) -> int:
        """How a rank that has ended ended (what the server says once it has seen it)."""
        while pid not in self.codes and not self.gone:
            self._receive()
        return self.codes.get(pid, -signal.SIGKILL)  # the server died, and the rank with it

    def stop(self) -> None:
        """Ends the server, and the ranks it forked with it (rank_server starts another)."""
        self.process.kill()
        self.process.wait()
        self.channel.close()
        self.gone = True

    def _receive(self) -> tuple[dict | None, list[int]]:
        """The server's next message (None at its end) and the descriptors beside it."""
        data, fds, _, _ = socket.recv_fds(self.channel, server.MESSAGE_BYTES, 1)
        if not data:
            self.gone = True
            return None, []
        message = json.loads(data)
        if "ended" in message:
            self.codes[message["ended"]] = message["code"]
        return message, fds


@dataclass
class Rank:
    """One rank process, the pidfd the worker holds on it, and the worker's end of the
    pipe that announces its jobs (the rank's end closing as the worker dies or lets it
    go)."""

    pid: int
    pidfd: int
    jobs: BinaryIO
    server: RankServer

    @property
    def exitcode(self) -> int | None:
        """None while it runs, else how it ended (a signal as a negative number)."""
        if not self.wait(0):
            return None
        return self.server.code(self.pid)

    def wait(self, timeout: float | None) -> bool:
        """Whether it has ended, within `timeout` seconds."""
        return bool(select.select([self.pidfd], [], [], timeout)[0])

    def send_signal(self, number: int) -> None:
        with suppress(ProcessLookupError):  # it has ended, and the server has reaped it
            signal.pidfd_send_signal(self.pidfd, number)

    def close(self) -> None:
        """Lets go of the pipe and the pidfd; the process is the server's to reap."""
        self.jobs.close()
        os.close(self.pidfd)


class Servers:
    """This process's rank fork server, started again should it have died."""

    server: RankServer | None = None


def rank_server() -> RankServer:
    """This worker's rank fork server: started now unless it runs. It imports torch and the
    trainer meanwhile; a rank asked of it before then starts once they are done."""
    if Servers.server is None or Servers.server.process.poll() is not None:
        Servers.server = RankServer()
    return Servers.server
