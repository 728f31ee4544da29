"""What a train worker's process keeps of the run it last trained, for that run's next
job: the training of a run of one rank, trained in this process (which takes the next job's
steps on a thread until that job comes), or the rank processes of a run of several
(processes.py), kept from job to job.

The run's jobs are routed to the worker that holds it (models/train/routing.py), so that
they go on in memory; any other worker restores the checkpoint from the store.
"""

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sdq.models.train.routing import run_key
from sdq.models.train.specs import TrainShardSpec
from sdq.workers.train.ranks.processes import Node, RankGroup

if TYPE_CHECKING:
    from sdq.workers.train.loop.training import Training

logger = logging.getLogger(__name__)


class LiveStates:
    """What this process keeps of the run it last trained, for that run's next job: the
    training it checkpointed (a run of one rank, trained here), which takes the next job's
    steps on a thread until that job comes; or the rank processes holding it (a run of
    several). One at a time: a GPU that rank 0 of a group needs is never also holding a
    state trained here."""

    def __init__(self) -> None:
        self._training: Training | None = None
        self._ahead: Ahead | None = None
        self._group: RankGroup | None = None

    def take(self, spec: TrainShardSpec) -> "Training | None":
        """The training to go on with in this process, if the job goes on from it."""
        self._stop_group()
        self._stop_ahead()
        if self._training is not None and self._training.goes_on_to(spec):
            training, self._training = self._training, None
            return training
        self._drop_training()
        return None

    def keep(self, training: "Training", following: TrainShardSpec | None) -> None:
        """Keeps the training, taking the steps of the job that follows meanwhile."""
        self._training = training
        if following is not None:
            # Held before it starts: a Ctrl-C between the two would leave it running unheld.
            self._ahead = Ahead(training, following)
            self._ahead.start()

    def group(self, spec: TrainShardSpec, watch: Callable[[], None]) -> RankGroup:
        """The rank processes of the job's run, forked for it unless they serve it
        already."""
        if self._group is None or not self._group.serves(spec):
            self._new_group(spec, Node(), watch)
        return self._group

    def _new_group(self, spec: TrainShardSpec, node: Node, watch: Callable[[], None]) -> None:
        """What this process holds let go (the ranks need the devices), and ranks forked
        for the run as that node of it."""
        self.clear()
        self._group = RankGroup(spec, node, watch)

    def kept_gang_node(self, spec: TrainShardSpec) -> Node | None:
        """This node's place in the run's gang, if its ranks are kept here and can go on
        with this job."""
        if self._group is None or not self._group.serves(spec):
            return None
        return self._group.node

    def run_gang_node(
        self,
        spec: TrainShardSpec,
        node: Node,
        watch: Callable[[], None],
        stop_at: float | None,
        goes_on: bool,
    ) -> dict[str, Any] | None:
        """This node's ranks of a job over several nodes: those kept from the run's last job
        where the gang `goes_on` (every node agrees: gang/), else ranks forked for it now
        (the fork server's imports done). They are kept after the job; a failure stops
        them."""
        if not goes_on:
            self._new_group(spec, node, watch)
        try:
            return self._group.train(spec, stop_at, watch)
        except BaseException:
            self._group = None  # train() has stopped it
            raise

    def warm_keys(self) -> set[str]:
        """Where the jobs of the run held here find this worker (models/train/routing.py)."""
        if self._training is not None:
            return {run_key(self._training.state.run)}
        return {self._group.warm_key} if self._group is not None else set()

    def clear(self) -> None:
        """All of it let go: the devices for the next run, or as the process ends."""
        self._stop_group()
        self._stop_ahead()
        self._drop_training()

    def _stop_ahead(self) -> None:
        if self._ahead is not None and not self._ahead.stop():
            self._drop_training()  # it failed mid-step: the state is not any step's
        self._ahead = None

    def _drop_training(self) -> None:
        """Lets the kept training go, its device memory with it."""
        if self._training is None:
            return
        from sdq.workers.gpu import release_device_memory

        self._training.close()
        self._training = None
        release_device_memory()

    def _stop_group(self) -> None:
        if self._group is not None:
            self._group.stop()
            self._group = None


class Ahead:
    """The steps of a run's next job, taken on a thread from the state its last job has
    just checkpointed, until the job comes to take them (or another job comes)."""

    def __init__(self, training: "Training", following: TrainShardSpec) -> None:
        self._stopping = threading.Event()
        # Waited for instead of a join. On Python 3.11 a join that Ctrl-C interrupts marks
        # the thread ended while it runs on (CPython gh-90882): the exit's stop would then
        # return at once, and a thread still in a step as the interpreter goes aborts the
        # process ("terminate called without an active exception", pytorch#38228).
        self._ended = threading.Event()
        self._failed = False
        self._work: tuple[Training, TrainShardSpec] | None = (training, following)
        self._thread = threading.Thread(target=self._take_steps, name="sdq-train-ahead")
        # It never holds the process open: stop() ends it, and an exit stops it (task.py).
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    def _take_steps(self) -> None:
        training, following = self._work
        try:
            if not self._stopping.is_set():  # not stopped before it began
                training.train_ahead(following, self._stopping.is_set)
        except BaseException as error:
            logger.warning("steps ahead of run %s's next job failed: %r", following.run, error)
            self._failed = True
        finally:
            # Let go before the stop returns: a state this thread freed later would leave
            # its device memory in the allocator's cache, after the caller emptied it.
            self._work = training = None
            self._ended.set()

    def stop(self) -> bool:
        """Stops it at its window's end; whether the state is still a step's. Interrupted,
        it may be called again, and waits as long."""
        self._stopping.set()
        # A thread that never started (start() interrupted, or never reached) has no ident
        # and, stopped before it began, will take no step.
        if self._thread.ident is not None:
            self._ended.wait()
        return not self._failed
