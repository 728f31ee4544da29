"""A run's checkpoints: the state copied to host memory at a step (a snapshot), written to
the object store from that copy on a thread while the training goes on (the devices wait
for the copy, not for the upload), with the whole pipeline beside it when the checkpoint
is a model; and a job's starting state restored from the store. Every checkpoint holds
everything needed to go on exactly where it was written. GPU-side: imports torch.
"""

import fcntl
import hashlib
import io
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from time import perf_counter
from typing import Any, TypeVar

import numpy as np
import torch
from diffusers import UNet2DConditionModel

from sdq.models.registry import content_hash, folder_content_hash
from sdq.models.store import ObjectStore
from sdq.models.train.specs import TrainShardSpec, checkpoint_prefix
from sdq.workers.train.loop.build import (
    base_unet,
    export_model,
    fetch_base_ahead,
    fetched_base,
    new_state,
)
from sdq.workers.train.loop.files import UNET_FOLDER, load_state, save_state, save_unet
from sdq.workers.train.loop.sharding import (
    SHARDED_FOLDER,
    ShardedSnapshot,
    every_rank_hashes,
    is_sharded,
    restore,
    shard_hashes,
    unet_weights,
)
from sdq.workers.train.loop.state import ALONE, Ranks, TrainState
from sdq.workers.train.records import Written
from sdq.workers.weights import ModelFiles


@dataclass(frozen=True)
class Snapshot:
    """The training state at one step, copied to host memory: what a checkpoint writes, from
    a thread, while the training goes on from the same state on the device."""

    step: int
    unet_config: dict
    unet: dict[str, torch.Tensor]  # the U-Net's state dict
    # The optimizer's, learning rate scheduler's, EMA's and gradient scaler's state dicts.
    training: dict[str, Any]
    # The U-Net's state dict with the EMA's weights (the same tensors as its state dict's).
    ema_unet: dict[str, torch.Tensor] | None
    seconds: float  # how long the training waited for the copy

    @property
    def model_weights(self) -> dict[str, torch.Tensor]:
        """The U-Net's weights a model made from this checkpoint has: the EMA's, when kept."""
        return self.unet if self.ema_unet is None else self.ema_unet


def snapshot(state: TrainState) -> Snapshot:
    """The state's copy on the host, into pinned memory from a GPU (one wait for all the
    copies), contiguous as safetensors writes it."""
    started = perf_counter()
    unet = _host_copies(state.unet.state_dict(), state.device)
    training = _host_copies(
        {
            "optimizer": state.optimizer.state_dict(),
            "lr_scheduler": state.lr_scheduler.state_dict(),
            "ema": state.ema.state_dict() if state.ema is not None else None,
            "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        },
        state.device,
    )
    if state.device.type == "cuda":
        torch.cuda.synchronize(state.device)
    ema_unet = None
    if state.ema is not None:
        # One shadow per parameter, in the U-Net's parameter order.
        names = [name for name, _ in state.unet.named_parameters()]
        shadows = training["ema"]["shadow_params"]
        ema_unet = {**unet, **dict(zip(names, shadows, strict=True))}
    return Snapshot(
        state.step,
        dict(state.unet.config),
        unet,
        training,
        ema_unet,
        seconds=perf_counter() - started,
    )


def _host_copies(value: Any, device: torch.device) -> Any:
    """A state dict with its tensors copied to the host and its containers copied too: the
    live ones change with the next step."""
    if isinstance(value, torch.Tensor):
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=device.type == "cuda")
        return host.copy_(value.detach(), non_blocking=True)
    if isinstance(value, dict):
        return {key: _host_copies(item, device) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copies(item, device) for item in value)
    return value


def save_checkpoint(snapshot: Snapshot, folder: Path) -> None:
    """The U-Net as diffusers saves it, and the rest of the training state beside it. No
    generator state: every draw is a function of the seed and the step, so the same run
    writes the same bytes, and any world size can go on from it."""
    save_unet(snapshot.unet_config, snapshot.unet, folder / UNET_FOLDER)
    save_state({"step": snapshot.step, **snapshot.training}, folder)


def load_checkpoint(spec: TrainShardSpec, folder: Path, ranks: Ranks = ALONE) -> TrainState:
    """The state a checkpoint folder holds, as it was when written."""
    if is_sharded(folder):
        state = new_state(spec, _laid_out(folder), ranks)
        restore(state, folder)
        return state
    state = new_state(spec, UNet2DConditionModel.from_pretrained(folder / UNET_FOLDER), ranks)
    saved = load_state(folder, state.device)
    state.step = saved["step"]
    restore_optimizer(state.optimizer, saved["optimizer"])
    state.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    if state.ema is not None:
        state.ema.load_state_dict(saved["ema"])
    if state.scaler is not None:
        state.scaler.load_state_dict(saved["scaler"])
    return state


def _laid_out(folder: Path) -> UNet2DConditionModel:
    """The checkpoint's U-Net on the meta device: shapes, no memory, to be restored into."""
    with torch.device("meta"):
        return UNet2DConditionModel.from_config(
            UNet2DConditionModel.load_config(folder / UNET_FOLDER)
        )


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """The optimizer's saved state, each parameter's in the parameter's own memory layout:
    a checkpoint gives it back contiguous, beside channels_last weights, which takes AdamW
    off its fused and foreach paths (they need matching strides)."""
    optimizer.load_state_dict(saved)
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            for name, value in optimizer.state.get(parameter, {}).items():
                if (
                    torch.is_tensor(value)
                    and value.shape == parameter.shape
                    and value.stride() != parameter.stride()
                ):
                    like = torch.empty_like(parameter, dtype=value.dtype)
                    optimizer.state[parameter][name] = like.copy_(value)


T = TypeVar("T")


# Objects a checkpoint puts in the store at once.
UPLOAD_THREADS = 8


def write_checkpoint(
    spec: TrainShardSpec, snapshot: Snapshot | ShardedSnapshot, store: ObjectStore,
    files: ModelFiles,
) -> Written | None:  # fmt: skip
    """The training state in the store, and the whole pipeline beside it when this
    checkpoint is a model; what rank 0 records of it (None on the other ranks of a sharded
    run, which write their own parts)."""
    if isinstance(snapshot, ShardedSnapshot):
        return _write_sharded(spec, snapshot, store, files)
    prefix = checkpoint_prefix(spec.run, snapshot.step)
    # The model (when the checkpoint is one) is written beside the state, on a thread.
    with ThreadPoolExecutor(1, thread_name_prefix="sdq-model") as beside:
        model = beside.submit(_write_model, spec, snapshot, store, files)
        with tempfile.TemporaryDirectory(prefix="sdq-checkpoint-") as temporary:
            folder = Path(temporary)
            save_checkpoint(snapshot, folder / "state")
            state_sha256 = _upload(store, prefix, folder, sorted(folder.rglob("*")),
                                   lambda: folder_content_hash(folder / "state"))  # fmt: skip
        model_prefix, revision = model.result()
    # The training waited for the snapshot only: the rest overlaps the next steps.
    return Written(snapshot.step, store.uri(prefix), state_sha256, model_prefix, revision,
                   snapshot.seconds)  # fmt: skip


def _write_sharded(
    spec: TrainShardSpec, snapshot: ShardedSnapshot, store: ObjectStore, files: ModelFiles
) -> Written | None:
    """This rank's part in the store; on rank 0, once every rank's is there, the whole
    checkpoint's hash (of every part's) and its model."""
    prefix = checkpoint_prefix(spec.run, snapshot.step)
    try:
        own = _upload(store, f"{prefix}/state", snapshot.folder, snapshot.files(),
                      lambda: shard_hashes(snapshot))  # fmt: skip
        hashes = every_rank_hashes(snapshot, own)
        if snapshot.rank != 0:
            return None
        model_prefix, revision = _write_model(spec, snapshot, store, files)
    finally:
        snapshot.close()
    return Written(snapshot.step, store.uri(prefix), content_hash(sorted(hashes.items())),
                   model_prefix, revision, snapshot.seconds)  # fmt: skip


def _write_model(
    spec: TrainShardSpec, snapshot: Snapshot | ShardedSnapshot, store: ObjectStore,
    files: ModelFiles,
) -> tuple[str | None, str | None]:  # fmt: skip
    """The whole pipeline in the store when the checkpoint is a model (at the step the job
    reached, which is its last unless it stopped early): its prefix and content hash."""
    if not replace(spec, last_step=snapshot.step).exports_model:
        return None, None
    prefix = f"{checkpoint_prefix(spec.run, snapshot.step)}/model"
    with tempfile.TemporaryDirectory(prefix="sdq-model-") as temporary:
        folder = Path(temporary)
        base = fetched_base(spec, files)
        export_model(snapshot.unet_config, snapshot.model_weights, base, folder)
        revision = _upload(store, prefix, folder, sorted(folder.rglob("*")),
                           lambda: folder_content_hash(folder))  # fmt: skip
    return prefix, revision


def _upload(
    store: ObjectStore, prefix: str, folder: Path, paths: list[Path], hashing: Callable[[], T]
) -> T:
    """The files put at once (a checkpoint is a dozen objects or more, each a round trip,
    and the last one's write is on the run's clock), and what `hashing` returns, hashed on
    a thread meanwhile: both read the files from the page cache, and hashing SD 2's state
    (12.9 GB) takes seconds that would otherwise add to the upload's."""
    with ThreadPoolExecutor(UPLOAD_THREADS + 1, thread_name_prefix="sdq-upload") as uploads:
        hashed = uploads.submit(hashing)
        for put in [
            uploads.submit(store.put_file, f"{prefix}/{path.relative_to(folder).as_posix()}", path)
            for path in paths
            if path.is_file()
        ]:
            put.result()
        return hashed.result()


def restore_state(
    spec: TrainShardSpec,
    store: ObjectStore,
    files: ModelFiles,
    ranks: Ranks,
    node_folder: Path | None = None,
) -> TrainState:
    """The state the job starts from: the run's first (the base's U-Net, a new one, or the
    weights of the checkpoint the run goes on from), or its checkpoint at the first step.
    Ranks that share a `node_folder` (one node's) download a checkpoint once between them."""
    if spec.first_step == 0:
        state = new_state(spec, _first_unet(spec, store, files, node_folder), ranks)
    else:
        prefix = f"{checkpoint_prefix(spec.run, spec.first_step)}/state/"
        with downloaded(store, prefix, node_folder) as folder:
            state = load_checkpoint(spec, folder, ranks)
    if spec.options.caption_dropout:
        state.empty_prompt = empty_prompt(store, spec.empty_prompt_key).to(state.device)
    if ranks.writes:
        fetch_base_ahead(spec, files)  # after the restore: it may have fetched them already
    return state


def _first_unet(
    spec: TrainShardSpec, store: ObjectStore, files: ModelFiles, node_folder: Path | None
):
    if spec.start_from is None:
        return base_unet(spec, files)
    state = f"{spec.start_from}/state/"
    if next(store.list_keys(f"{state}{SHARDED_FOLDER}/"), None) is None:
        with downloaded(store, f"{state}unet/", node_folder) as folder:
            return UNet2DConditionModel.from_pretrained(folder)
    # Written by a sharded run, at whatever world size: each rank reads the whole U-Net.
    with downloaded(store, state, node_folder) as folder:
        return unet_weights(folder)


@contextmanager
def downloaded(store: ObjectStore, prefix: str, node_folder: Path | None) -> Iterator[Path]:
    """The objects under a prefix, in a local folder while the block runs; in
    `node_folder`, shared with the node's other ranks, who find it there (the first to
    come downloads it, the others wait for it on a lock)."""
    if node_folder is None:
        with tempfile.TemporaryDirectory(prefix="sdq-checkpoint-") as folder:
            _download(store, prefix, Path(folder))
            yield Path(folder)
        return
    restores = node_folder / "restores"
    restores.mkdir(exist_ok=True)
    folder = restores / hashlib.sha256(prefix.encode()).hexdigest()[:16]
    with (restores / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / DOWNLOADED).is_file():
            # The node's earlier restores: every rank has gone past them, to this one.
            for older in restores.iterdir():
                if older.is_dir():
                    shutil.rmtree(older)
            _download(store, prefix, folder)
            (folder / DOWNLOADED).touch()
    yield folder


# Marks a node's shared download complete.
DOWNLOADED = ".downloaded"


def _download(store: ObjectStore, prefix: str, folder: Path) -> None:
    for key in store.list_keys(prefix):
        store.get_file(key, folder / key.removeprefix(prefix))


def empty_prompt(store: ObjectStore, key: str | None) -> torch.Tensor:
    """The text encoder's output for "" (tokens x hidden size), as the encode run stored it."""
    if key is None:
        raise ValueError("caption dropout needs the empty prompt's embedding; the spec has none")
    return torch.from_numpy(np.load(io.BytesIO(store.get_bytes(key))).astype(np.float32))
