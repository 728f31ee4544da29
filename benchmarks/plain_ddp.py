"""The plain way to train data-parallel: one torchrun, one DDP loop over latent shards on
local disk, no queue, no database, no object store, no checkpoints. The same step as sdq's
(`train_step`: DDP across the ranks, AdamW, DDPM noise, min-SNR MSE, EMA on rank 0), so
that benchmarks/train_scaling.py measures what sdq's orchestration costs.

    torchrun --nproc-per-node N benchmarks/plain_ddp.py SPEC.json SHARDS_DIR
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sdq.models.training import TrainShardSpec  # noqa: E402
from sdq.workers.train.data import LatentStream  # noqa: E402
from sdq.workers.train.trainer import (  # noqa: E402
    Ranks,
    base_unet,
    new_state,
    on_device,
    train_step,
)


def main(spec_file: Path, shards: Path) -> None:
    spec = TrainShardSpec.from_dict(json.loads(spec_file.read_text()))
    ranks = Ranks(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    state = new_state(spec, base_unet(spec, files=None), ranks)
    stream = LatentStream(
        spec.inputs,
        seed=spec.options.seed,
        batch_size=spec.options.batch_size,
        read=lambda key: (shards / key).read_bytes(),
    )
    part = ranks.part(spec.options.batch_size)
    for latents, embeddings in on_device(stream.batches(0, part), state.device):
        train_step(state, spec, latents, embeddings)
        if state.step == spec.options.steps:
            break
    dist.barrier()
    # As a rank of sdq's does: freeing DDP's reducer at exit can deadlock with gloo.
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
