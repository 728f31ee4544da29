"""Training plans on the meta device: Stable Diffusion 2's U-Net at the sizes the seed's
pre-training ran per GPU, the parts that change with each option, and a configuration that
does not fit, refused by `sdq train plan` and by `sdq train` before anything is queued.
Each test plans once through the command line, as a user does (its options, the planner's
process); the configurations it compares it plans with the planner itself, in this
process."""

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel
from peft import LoraConfig

from sdq.models.train.architectures import UNET_ARCHITECTURES
from sdq.workers.train import plan as planner
from tests.conftest import run_sdq
from tests.services import clean_env

# diffusers' stabilityai/stable-diffusion-2-base U-Net holds this many parameters.
SD2_UNET_PARAMETERS = 865_910_724
# and stabilityai/stable-diffusion-xl-base-1.0's this many.
SDXL_UNET_PARAMETERS = 2_567_463_684
GIB = 2**30


def sdq(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**clean_env(), "SDQ_HOME": str(cwd / "home")}
    return run_sdq(env, *args, cwd=cwd, timeout=240)


def planned(tmp_path: Path, *args: str) -> dict:
    done = sdq("train", "plan", "--unet-config", "sd2-base", *args, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def planned_here(**request) -> dict:
    """SD 2's plan from the planner in this process, as the command's JSON has it."""
    config = UNET_ARCHITECTURES["sd2-base"]
    return asdict(planner.plan(planner.PlanRequest(unet_config=config, **request)))


def test_sd2_at_the_seed_s_sizes_per_gpu_fits_an_80gb_gpu(tmp_path: Path) -> None:
    # The seed trained 256 px at 128 and 512 px at 32 per GPU (32 GPUs: global batches of
    # 4,096 and 1,024).
    at_256 = planned(tmp_path, "--resolution", "256", "--batch-size", "4096", "--world-size", "32")
    at_512 = planned_here(resolution=512, batch_size=1024, world_size=32)
    for plan in (at_256, at_512):
        assert set(plan["parts"]) == {"parameters", "gradients", "optimizer", "ema", "activations"}
        assert plan["parts"]["parameters"] == 4 * SD2_UNET_PARAMETERS
        assert plan["parts"]["optimizer"] == 8 * SD2_UNET_PARAMETERS  # AdamW's two moments
        assert plan["per_gpu_bytes"] == sum(plan["parts"].values())
        assert plan["fits"] and plan["per_gpu_bytes"] < 70 * GIB
    assert (at_256["micro_batch"], at_512["micro_batch"]) == (128, 32)
    # Four times the pixels, and attention over four times the tokens: more than 4x.
    assert 4 < at_512["flops_per_sample"] / at_256["flops_per_sample"] < 5
    # SD 2's U-Net forward at 256 px is ~180 GFLOPs; training counts it three times.
    assert 500e9 < at_256["flops_per_sample"] < 600e9
    # The screen says what GPU it planned for: the default, with the option that sets it.
    shown = sdq("train", "plan", "--unet-config", "sd2-base", "--resolution", "256",
                "--batch-size", "4096", "--world-size", "32", cwd=tmp_path)  # fmt: skip
    usable = at_256["usable_bytes"] / GIB
    said = f"fits within {usable:.1f} GiB usable of each GPU's 74.5 GiB (--gpu-memory)"
    assert said in " ".join(shown.stdout.split()), shown.stdout


def test_sdxl_s_u_net_is_planned_with_its_added_conditions(tmp_path: Path) -> None:
    """SDXL's U-Net (`--unet-config sdxl`), its pooled embedding and time ids given: at
    1,024 px on eight GPUs, one sample each, it fits an 80 GB GPU with recomputed
    activations; at 512 px it costs more than a quarter of that."""
    args = ["--resolution", "1024", "--batch-size", "8", "--world-size", "8"]
    shown = sdq("train", "plan", "--unet-config", "sdxl", *args, "--gradient-checkpointing",
                "--json", cwd=tmp_path)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    at_1024 = json.loads(shown.stdout)
    assert at_1024["parts"]["parameters"] == 4 * SDXL_UNET_PARAMETERS
    assert at_1024["fits"] and at_1024["micro_batch"] == 1
    request = {"resolution": 512, "batch_size": 8, "world_size": 8, "gradient_checkpointing": True}
    at_512 = planner.plan(planner.PlanRequest(unet_config=UNET_ARCHITECTURES["sdxl"], **request))
    assert 4 < at_1024["flops_per_sample"] / at_512.flops_per_sample < 5


def test_each_option_changes_the_part_it_should(tmp_path: Path) -> None:
    plain = planned(tmp_path, "--resolution", "512", "--batch-size", "16")
    assert plain == planned_here(resolution=512, batch_size=16)  # the command's is the planner's
    doubled = planned_here(resolution=512, batch_size=32)
    recomputed = planned_here(resolution=512, batch_size=16, gradient_checkpointing=True)
    full_precision = planned_here(resolution=512, batch_size=16, mixed_precision="no")
    without_ema = planned_here(resolution=512, batch_size=16, ema=False)
    activations = plain["parts"]["activations"]
    # Twice the samples keep twice the activations; autocast's weight copies stay one.
    assert 1.8 * activations < doubled["parts"]["activations"] < 2 * activations
    assert recomputed["parts"]["activations"] < activations / 3
    assert full_precision["parts"]["activations"] > 1.5 * activations
    assert without_ema["parts"]["ema"] == 0
    # On buckets, planned for a bucket of most pixels (768x384 at 512²): an eighth more.
    bucketed = planned(tmp_path, "--resolution", "512", "--batch-size", "16", "--buckets")
    assert bucketed["parts"]["activations"] == pytest.approx(1.125 * activations, rel=0.03)
    assert {plan["flops_per_sample"] for plan in (plain, recomputed, without_ema)} == {
        plain["flops_per_sample"]
    }


def test_a_configuration_that_does_not_fit_is_refused_with_what_would_make_it(
    tmp_path: Path,
) -> None:
    too_big = ("--resolution", "512", "--batch-size", "64", "--gpu-memory", "40GB")
    found = planned_here(resolution=512, batch_size=64, gpu_memory=40 * 10**9)
    assert not found["fits"] and found["would_fit_with"] == "--gradient-checkpointing"
    shown = sdq("train", "plan", "--unet-config", "sd2-base", *too_big, cwd=tmp_path)
    assert "does not fit" in shown.stdout and "--gradient-checkpointing" in shown.stdout
    config = tmp_path / "sd2.json"
    config.write_text(json.dumps(UNET_ARCHITECTURES["sd2-base"]))
    refused = sdq(
        "train", "anything", "--base", "tiny", "--from-scratch", "--unet-config", str(config),
        "--steps", "10", *too_big, cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "--gradient-checkpointing would make it fit" in refused.stderr
    assert not (tmp_path / "home").exists()  # nothing written, nothing queued


def test_sharding_spreads_the_state_over_the_ranks_and_is_offered_when_it_would_fit(
    tmp_path: Path,
) -> None:
    over_8 = {"resolution": 512, "batch_size": 256, "world_size": 8}
    ddp = planned_here(**over_8)
    grad_op = planned_here(**over_8, sharding="grad-op")
    full = planned(tmp_path, "--resolution", "512", "--batch-size", "256", "--world-size", "8",
                   "--sharding", "full")  # fmt: skip
    whole = ddp["parts"]
    # Optimizer and EMA are 1/8 of DDP's on each GPU under both; grad-op holds every
    # weight gathered through a step, full only two blocks' beside its shard.
    for sharded in (grad_op, full):
        assert sharded["parts"]["optimizer"] == -(-whole["optimizer"] // 64) * 8
        assert sharded["parts"]["ema"] == -(-whole["ema"] // 32) * 4
        assert sharded["parts"]["gradients"] < whole["gradients"] / 2
        assert sharded["parts"]["activations"] == whole["activations"]
    assert grad_op["parts"]["parameters"] > whole["parameters"]
    assert full["parts"]["parameters"] < whole["parameters"]
    assert full["per_gpu_bytes"] < grad_op["per_gpu_bytes"] < ddp["per_gpu_bytes"]
    # What does not fit at 8 ranks is offered sharding first (it costs the least speed).
    tight = planned_here(**over_8, gpu_memory=40 * 10**9)
    assert not tight["fits"]
    assert tight["would_fit_with"].startswith("--sharding")
    alone = sdq("train", "plan", "--unet-config", "sd2-base", "--resolution", "512",
                "--batch-size", "8", "--sharding", "full", cwd=tmp_path)  # fmt: skip
    assert alone.returncode == 2
    assert "--sharding full spreads the state over ranks: give --world-size 2" in alone.stderr


def test_a_lora_plans_its_adapters_state_beside_the_frozen_u_net(tmp_path: Path) -> None:
    """Under `--lora-rank`, the gradients, AdamW's moments and the EMA are the adapters'
    alone (counted here with peft itself, on the meta device), the frozen U-Net's weights
    stay, and what does not fit is never offered sharding (a LoRA is refused it)."""
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNET_ARCHITECTURES["sd2-base"])
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    adapters = sum(p.numel() for p in unet.parameters() if p.requires_grad)
    assert 0 < adapters < SD2_UNET_PARAMETERS / 100
    lora = planned(tmp_path, "--resolution", "512", "--batch-size", "16", "--lora-rank", "16")
    whole = planned_here(resolution=512, batch_size=16)["parts"]
    # The frozen weights in bf16 (the plan's GPU precision), the adapters in fp32.
    assert lora["parts"]["parameters"] == 2 * SD2_UNET_PARAMETERS + 4 * adapters
    assert (lora["parts"]["gradients"], lora["parts"]["optimizer"], lora["parts"]["ema"]) == (
        4 * adapters, 8 * adapters, 4 * adapters
    )  # fmt: skip
    # No weight gradient of a frozen layer: the backward keeps less of the forward.
    assert lora["parts"]["activations"] < whole["activations"]
    tight = planned_here(resolution=512, batch_size=256, world_size=8, lora_rank=16,
                         gpu_memory=16 * 10**9)  # fmt: skip
    assert not tight["fits"] and "--sharding" not in tight["would_fit_with"]


def test_a_u_net_the_planner_cannot_build_is_refused_with_the_reason(tmp_path: Path) -> None:
    """The planner's process fails (diffusers refuses the configuration): the command says
    why, in the planner's own words, and exits as a usage error."""
    config = tmp_path / "unet.json"
    config.write_text(json.dumps({"block_out_channels": [-3]}))
    done = sdq("train", "plan", "--unet-config", str(config), "--resolution", "64",
               "--batch-size", "1", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2
    assert "the planner failed: ValueError: Must provide the same number of `block_out_channels`" \
        in " ".join(done.stderr.split())  # fmt: skip


def test_a_planner_killed_as_it_plans_is_said_to_have_died(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planner's process killed (the kernel's out-of-memory killer, say): the command
    says how it died."""
    from sdq.producer.train import plan as planning

    (tmp_path / "killed_planner.py").write_text(
        "import os, signal\n\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(planning, "PLANNER", "killed_planner")
    with pytest.raises(planning.CannotPlan, match=r"^the planner died \(signal 9\)$"):
        planning.plan({})
