"""The job rhythm on the CPU path, with real threads and a real store. Steps taken ahead:
while a job's checkpoint is written, the run's next job's steps are taken on a thread from
the state just checkpointed; the job takes them over when it comes, and the run trains
exactly what one uninterrupted job trains. A job that does not go on from that checkpoint
finds nothing kept. A node's ranks restore a checkpoint with one download between them.
And a node of a job over several nodes keeps its ranks from job to job, forked for its
first job from the worker's rank fork server, until they fail. Ctrl-C as a job stops the
steps taken ahead leaves none running as the process ends."""

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch

from sdq.models.registry import tiny_identity
from sdq.models.store import LocalStore
from sdq.models.train.settings import TrainSettings
from sdq.models.train.specs import LatentInput, TrainOptions, TrainShardSpec
from sdq.workers.shards.latents import latent_shard_bytes
from sdq.workers.tiny import build_unet
from sdq.workers.train.gang.gathering import NodeLost
from sdq.workers.train.loop.build import downloaded, new_state
from sdq.workers.train.loop.checkpoints import snapshot
from sdq.workers.train.loop.training import Training
from sdq.workers.train.ranks.folder import DONE_FILE
from sdq.workers.train.ranks.live import LiveStates
from sdq.workers.train.ranks.processes import Node
from tests.services import wait_for
from tests.test_train_data import encoded

SETTINGS = TrainSettings(loss_every=2)


def never() -> bool:
    return False


@pytest.fixture
def run(tmp_path: Path) -> TrainShardSpec:
    return tiny_run(tmp_path)


def tiny_run(tmp_path: Path) -> TrainShardSpec:
    """A run of 8 steps in two jobs of 4, over two shards of tiny-sized latents."""
    store = LocalStore(tmp_path / "store")
    inputs = []
    for shard in range(2):
        tensors = encoded(6, seed=shard)  # the tiny U-Net's sizes
        key = f"latents/{shard}.parquet"
        lineage = {"key": [f"{shard}-{n}" for n in range(6)], "url": ["u"] * 6}
        data = latent_shard_bytes(lineage, tensors, {"dataset": "d"})
        store.put_bytes(key, data, content_type="application/vnd.apache.parquet")
        inputs.append(LatentInput(uri=store.uri(key), key=key, samples=6))
    model = tiny_identity()
    return TrainShardSpec(
        run=1, first_step=0, last_step=4, model_name="ahead", base_name=model.name,
        base_source=model.source, base_revision=model.revision, prediction_type="epsilon",
        scheduler_config=model.scheduler_config, inputs=tuple(inputs),
        options=TrainOptions(steps=8, batch_size=2, checkpoint_every=4, lr=1e-3, ema=0.9),
    )  # fmt: skip


def uninterrupted(run: TrainShardSpec, store: LocalStore) -> tuple[list[dict], Training]:
    """The run's 8 steps in one job: its steps, and its training at the end."""
    straight = Training(run, new_state(run, build_unet()), store, SETTINGS)
    whole = straight.steps(replace(run, last_step=8), never)
    straight.close()
    return whole, straight


def first_job_kept(run: TrainShardSpec, store: LocalStore):
    """The first job's steps and checkpoint, its training kept for the next job, which is
    taking its steps ahead meanwhile."""
    training = Training(run, new_state(run, build_unet()), store, SETTINGS)
    first = training.steps(run, never)
    checkpoint = training.checkpoint(run)
    live = LiveStates()
    following = run.next_after(training.state.step)
    live.keep(training, following)
    return training, first, checkpoint, live, following


def test_the_next_job_s_steps_are_taken_ahead_and_handed_to_it(run, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    whole, straight = uninterrupted(run, store)
    training, first, at_four, live, following = first_job_kept(run, store)
    # Until the steps taken ahead are handed over (all at once, after the last of them:
    # the state's step reaches 8 a moment before).
    deadline = time.monotonic() + 120
    while not training.ahead and time.monotonic() < deadline:
        time.sleep(0.05)
    # With no job to take them, the next job's steps were all taken, and no more.
    assert training.state.step == 8 and [step["step"] for step in training.ahead] == [5, 6, 7, 8]
    # The snapshot still holds step 4's values, though the state went on from it.
    assert at_four.step == 4 and not torch.equal(
        at_four.unet["conv_in.weight"], training.state.unet.state_dict()["conv_in.weight"]
    )
    taken = live.take(following)
    assert taken is training
    second = taken.steps(following, never)
    assert [step["step"] for step in first + second] == list(range(1, 9))
    assert [step["loss"] for step in first + second] == [step["loss"] for step in whole]
    assert_same_values(snapshot(taken.state).unet, snapshot(straight.state).unet)
    taken.close()


def test_a_job_that_comes_at_once_takes_over_mid_way(run, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    whole, _ = uninterrupted(run, store)
    training, first, _, live, following = first_job_kept(run, store)
    taken = live.take(following)  # stops the thread at its window's end, wherever it is
    assert taken is training and 4 <= taken.state.step <= 8
    second = taken.steps(following, never)
    assert [step["loss"] for step in first + second] == [step["loss"] for step in whole]
    taken.close()


def test_a_job_that_does_not_go_on_from_the_checkpoint_finds_nothing_kept(
    run, tmp_path: Path
) -> None:
    training = Training(run, new_state(run, build_unet()), LocalStore(tmp_path / "store"), SETTINGS)
    training.steps(run, never)
    training.checkpoint(run)
    live = LiveStates()
    live.keep(training, run.next_after(training.state.step))
    # The first job again (its checkpoint not recorded, say): it starts from step 0.
    assert live.take(run) is None
    assert live.take(run.next_after(4)) is None  # and the kept training is gone


def test_ctrl_c_as_a_job_stops_the_steps_ahead_still_stops_them_before_the_exit(
    run, tmp_path: Path
) -> None:
    """Ctrl-C lands while a job waits for the steps taken ahead to stop: the stop the exit
    makes (task.py's atexit) still waits for them. A step left running as the interpreter
    goes aborts the process instead of its exit code 130."""
    in_window, release, left_window = threading.Event(), threading.Event(), threading.Event()

    def slow_write(steps: list[dict]) -> None:
        """The first window taken ahead, written to a database that answers when told."""
        if threading.current_thread().name == "sdq-train-ahead" and not in_window.is_set():
            in_window.set()
            release.wait(120)
            left_window.set()

    store = LocalStore(tmp_path / "store")
    training = Training(run, new_state(run, build_unet()), store, SETTINGS, on_steps=slow_write)
    training.steps(run, never)
    training.checkpoint(run)
    live = LiveStates()
    following = run.next_after(training.state.step)
    live.keep(training, following)
    try:
        assert in_window.wait(120)
        press = threading.Thread(target=press_once_stopping, args=(live,))
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            press.start()
            with pytest.raises(KeyboardInterrupt):
                live.take(following)  # waits for the window's end: the press lands there
        finally:
            press.join()  # sent before the handler goes back: never to land in another test
            signal.signal(signal.SIGINT, previous)
        assert not left_window.is_set()
        threading.Timer(0.2, release.set).start()
        live.clear()  # as the process ends
        assert left_window.is_set()
    finally:
        release.set()
        live.clear()


def press_once_stopping(live: LiveStates) -> None:
    """Ctrl-C once the steps ahead are asked to stop: the job is waiting for them."""
    deadline = time.monotonic() + 120
    while not live._ahead._stopping.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)


def test_a_training_kept_in_the_worker_s_process_is_let_go_before_ranks_take_the_gpus(
    run, tmp_path: Path
) -> None:
    """A worker holding a run of one rank in its own process (on cuda:0 on a GPU) lets it
    go before a run of several ranks starts its rank processes, rank 0 on that GPU."""
    store = LocalStore(tmp_path / "store")
    _, _, _, live, following = first_job_kept(run, store)
    ranked = replace(run, run=run.run + 1, options=replace(run.options, world_size=2))
    try:
        group = live.group(ranked, lambda: None)
        assert len(group.ranks) == 2 and len(rank_processes_seen(2)) == 2
        assert live.warm_keys() == {f"run-{ranked.run}"}
        assert live.take(following) is None  # the kept training went first
    finally:
        live.clear()
    assert rank_processes() == []


def assert_same_values(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
    assert one.keys() == other.keys()
    assert all(torch.equal(one[name], other[name]) for name in one)


def test_a_node_s_ranks_download_a_checkpoint_once_between_them(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    prefix = "train/1/checkpoints/4/state/"
    for name in ("unet/config.json", "training.json"):
        store.put_bytes(prefix + name, name.encode(), content_type="application/json")
    node = tmp_path / "node"
    node.mkdir()
    with ThreadPoolExecutor(4) as ranks:
        folders = list(ranks.map(lambda _: enter(downloaded(store, prefix, node)), range(4)))
    assert len(set(folders)) == 1
    assert (folders[0] / "unet/config.json").read_bytes() == b"unet/config.json"
    # A rank that comes later reads the node's copy: the store is not asked again.
    for key in list(store.list_keys(prefix)):
        store.delete(key)
    with downloaded(store, prefix, node) as folder:
        assert (folder / "training.json").read_bytes() == b"training.json"
    # The next checkpoint's download replaces it.
    later = "train/1/checkpoints/8/state/"
    store.put_bytes(later + "training.json", b"8", content_type="application/json")
    with downloaded(store, later, node) as newer:
        assert (newer / "training.json").read_bytes() == b"8"
    assert not folders[0].exists()


def enter(context: AbstractContextManager[Path]) -> Path:
    with context as value:
        return value


def test_a_gang_node_keeps_its_ranks_from_job_to_job_until_they_fail(run) -> None:
    """The worker's side of a gang node's jobs, with real rank processes whose mark in the
    job's folder (normally written as they finish their part) comes from the test: the
    first job forks the node's rank, which is kept after it, where the run's leader calls
    this node (its warm queue), and the next job the gang goes on with runs on it; a job it
    fails stops it."""
    gang_run = replace(run, options=replace(run.options, nodes=2, world_size=2))
    live = LiveStates()
    during: list[list[int]] = []

    def done_at_every_second_look() -> None:
        ranks = rank_processes_seen(1)
        during.append([process.pid for process in ranks])
        if len(during) % 2 == 0:
            (folder_of(ranks[0]) / DONE_FILE.format(rank=0)).touch()

    def node_lost() -> None:
        raise NodeLost("node 0 is gone")

    try:
        node = Node(1, "127.0.0.1", 1)  # a rendezvous that never completes: no rank 0
        for goes_on in (False, True):  # a new gathering, then the gang going on
            # No result off node 0.
            assert (
                live.run_gang_node(gang_run, node, done_at_every_second_look, None, goes_on) is None
            )
            assert live.kept_gang_node(gang_run) == node
            assert live.warm_keys() == {f"run-{gang_run.run}-node-1"}
        [forked] = during[0]
        assert during == [[forked]] * 4  # no process started for the second job, or beside it
        with pytest.raises(NodeLost):
            live.run_gang_node(gang_run, node, node_lost, None, True)
        assert live.kept_gang_node(gang_run) is None and live.warm_keys() == set()
        assert rank_processes() == []
    finally:
        live.clear()


def folder_of(rank: psutil.Process) -> Path:
    """The job's folder, where the rank writes its log (its standard output)."""
    return Path(os.readlink(f"/proc/{rank.pid}/fd/1")).parent


def rank_processes_seen(count: int) -> list[psutil.Process]:
    """This process's rank processes, once `count` of them carry their name: a rank forked
    from the fork server names itself a moment after it starts."""
    seen: list[psutil.Process] = []

    def all_seen() -> bool:
        seen[:] = rank_processes()
        return len(seen) == count

    wait_for(all_seen, what=f"{count} rank processes", timeout=30)
    return seen


def rank_processes() -> list[psutil.Process]:
    """This process's live rank processes: forked from its rank fork server, named by their
    local rank. A rank that has ended is none, though its server may not have reaped it yet
    (the worker waits on a rank's end through its pidfd; the reaping is the server's)."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if (re.fullmatch(r"sdq-rank\d+", process.name())
                    and process.status() != psutil.STATUS_ZOMBIE):  # fmt: skip
                found.append(process)
        except psutil.NoSuchProcess:  # a rank that ended as it was looked at
            pass
    return found
