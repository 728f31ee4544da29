"""Sharded training (FSDP2) on two real gloo ranks under torchrun: each sharding follows
the DDP run's loss curve and weights, writes its checkpoint as each rank's part through
DCP, resumes from it bit for bit, and the checkpoint loads whole at another world size.
bf16 gradient communication changes the arithmetic it should, and resumes exactly too."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import load_file

from sdq.models.registry import content_hash, file_sha256
from sdq.models.train.specs import checkpoint_prefix
from sdq.workers.train.loop.build import load_checkpoint
from sdq.workers.train.loop.sharding import is_sharded, unet_weights
from sdq.workers.train.loop.state import Ranks
from tests.services import clean_env
from tests.sharded.train_two_ranks import spec

SCRIPT = Path(__file__).parent / "sharded" / "train_two_ranks.py"
# What the tests compare (sharding, gradient communication), trained by one pair of ranks
# for all of them: a pair of rank processes costs ~15 s of CPU in imports alone. The tests
# share it in one test process.
CONFIGURATIONS = [("none", "fp32"), ("grad-op", "fp32"), ("full", "fp32"), ("none", "bf16"),
                  ("full", "bf16")]  # fmt: skip
pytestmark = pytest.mark.xdist_group("sharded-ranks")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The script's output folder, a folder in it per configuration."""
    out = tmp_path_factory.mktemp("sharded")
    env = {**clean_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), str(out), *(f"{sharding}:{grad}" for sharding, grad in CONFIGURATIONS)],
        env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def two_ranks(trained: Path, sharding: str, grad_comm: str = "fp32") -> Path:
    """This configuration's output folder."""
    assert (sharding, grad_comm) in CONFIGURATIONS
    return trained / f"{sharding}-{grad_comm}"


def losses(out: Path) -> dict[str, list[float]]:
    return json.loads((out / "losses.json").read_text())


def weights(out: Path, which: str) -> dict[str, torch.Tensor]:
    return load_file(out / f"{which}.safetensors")


def state_folder(out: Path, step: int) -> Path:
    return out / "store" / checkpoint_prefix(0, step) / "state"


@pytest.mark.parametrize("sharding", ["grad-op", "full"])
def test_sharded_ranks_follow_ddp_and_resume_exactly_from_their_parts(
    trained: Path, sharding: str
) -> None:
    ddp, sharded = two_ranks(trained, "none"), two_ranks(trained, sharding)
    assert losses(sharded)["straight"] == pytest.approx(losses(ddp)["straight"], rel=1e-5)
    for name, tensor in weights(ddp, "straight").items():
        torch.testing.assert_close(weights(sharded, "straight")[name], tensor, rtol=0, atol=1e-6)
    # Restored from step 2's checkpoint, steps 3 and 4 again: the same, bit for bit.
    assert losses(sharded)["resumed"] == losses(sharded)["straight"][2:]
    straight, resumed = weights(sharded, "straight"), weights(sharded, "resumed")
    assert straight.keys() == resumed.keys() and any(name.startswith("ema.") for name in straight)
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    # Each rank wrote its own part; the recorded hash covers every part.
    folder = state_folder(sharded, 2)
    parts = sorted(path.name for path in (folder / "sharded").iterdir())
    assert parts == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    files = [path for path in folder.rglob("*") if path.is_file()]
    written = json.loads((sharded / "written-2.json").read_text())
    assert written["state_sha256"] == content_hash(
        (path.relative_to(folder).as_posix(), file_sha256(path)) for path in files
    )
    assert not (state_folder(ddp, 2) / "sharded").exists()


def test_a_sharded_checkpoint_loads_whole_at_another_world_size(trained: Path) -> None:
    out = two_ranks(trained, "full")
    folder = state_folder(out, 4)
    assert is_sharded(folder)
    # One process, no process group, no sharding: DCP reshards the two ranks' parts.
    alone = replace(spec("full", "fp32"), first_step=4, last_step=4)
    alone = replace(alone, options=replace(alone.options, world_size=1, sharding="none"))
    state = load_checkpoint(alone, folder, Ranks())
    at_four = weights(out, "straight")
    assert state.step == 4 and not state.sharded
    unet = state.unet.state_dict()
    assert all(torch.equal(unet[name], at_four[name]) for name in unet)
    names = [name for name, _ in state.unet.named_parameters()]
    for name, shadow in zip(names, state.ema.shadow_params, strict=True):
        assert torch.equal(shadow, at_four[f"ema.{name}"])
    adam = state.optimizer.state[state.unet.conv_in.weight]
    assert adam["step"].item() == 4 and adam["exp_avg"].abs().sum() > 0
    assert state.lr_scheduler.last_epoch == 4
    # A new run that starts from it reads the U-Net alone, whole.
    started = unet_weights(folder).state_dict()
    assert all(torch.equal(started[name], at_four[name]) for name in started)
    # The model exported at the run's last step has the EMA's weights, gathered.
    model = store_model(out, 4)
    assert all(torch.equal(model[name], at_four[f"ema.{name}"]) for name in names)


def store_model(out: Path, step: int) -> dict[str, torch.Tensor]:
    folder = out / "store" / checkpoint_prefix(0, step) / "model"
    return UNet2DConditionModel.from_pretrained(folder / "unet").state_dict()


@pytest.mark.parametrize("sharding", ["none", "full"])
def test_bf16_gradient_communication_rounds_what_crosses_and_still_resumes_exactly(
    trained: Path, sharding: str
) -> None:
    fp32 = losses(two_ranks(trained, sharding))["straight"]
    bf16 = losses(two_ranks(trained, sharding, "bf16"))
    # Step 1 has a learning rate of 0 (warmup): the steps after it see the rounding.
    assert bf16["straight"][:2] == fp32[:2] and bf16["straight"][2:] != fp32[2:]
    assert bf16["straight"] == pytest.approx(fp32, rel=1e-4)
    assert bf16["resumed"] == bf16["straight"][2:]
