"""The training state as files whose bytes depend on its values alone: its tensors in a
safetensors file, everything else as JSON that names them. torch.save would pickle it, and a
pickle's bytes also depend on which Python objects happen to be shared (a learning rate in
two places is written once or twice), so a run resumed from a checkpoint wrote the same
values as an uninterrupted one in other bytes. The U-Net beside it is a folder as
diffusers writes one. GPU-side: imports torch.
"""

import json
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import UNet2DConditionModel
from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
from safetensors.torch import load_file, save_file

TENSORS_FILE = "training.safetensors"
# A LoRA run's checkpoint holds its adapter's weights here in place of the U-Net.
ADAPTER_FILE = "adapter.safetensors"
UNET_FOLDER = "unet"  # a pipeline's U-Net, and a checkpoint's, as diffusers names it
VALUES_FILE = "training.json"


def save_state(value: Any, folder: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(value, "", tensors)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()},
              folder / TENSORS_FILE)  # fmt: skip
    (folder / VALUES_FILE).write_text(json.dumps(encoded, sort_keys=True, indent=1))


# What diffusers' config.json leaves out of a model's config.
UNSAVED_CONFIG = ("_ignore_files", "_use_default_values")


def save_unet(config: dict, weights: dict[str, torch.Tensor], folder: Path) -> None:
    """The U-Net's folder as diffusers' save_pretrained writes it (config.json and one
    safetensors file), without building the module to call it on: SD 2's, even on the
    meta device, takes 0.14-0.45 s of the interpreter, twice a checkpoint (its state's and
    its model's), on threads beside the training's."""
    save_unet_config(config, folder)
    save_file(weights, folder / SAFETENSORS_WEIGHTS_NAME, metadata={"format": "pt"})


def save_unet_config(config: dict, folder: Path) -> None:
    """The U-Net's config.json as diffusers writes it, named by the U-Net's class (not a
    subclass FSDP made of it)."""
    saved = {key: value for key, value in config.items() if key not in UNSAVED_CONFIG}
    saved.update(_class_name=UNet2DConditionModel.__name__,
                 _diffusers_version=diffusers.__version__)  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(saved, indent=2, sort_keys=True) + "\n"
    (folder / UNet2DConditionModel.config_name).write_text(text)


def load_state(folder: Path, device: torch.device) -> Any:
    tensors = load_file(folder / TENSORS_FILE, device=str(device))
    return _decode(json.loads((folder / VALUES_FILE).read_text()), tensors)


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for a state dict: tensors by name, and the dicts (whose keys may be numbers, as
    an optimizer's are) and tuples tagged so they come back as they were."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach()
        return {"tensor": path}
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda item: (type(item[0]).__name__, item[0]))
        return {"dict": [[key, _encode(item, f"{path}/{key}", tensors)] for key, item in items]}
    if isinstance(value, list | tuple):
        encoded = [_encode(item, f"{path}/{index}", tensors) for index, item in enumerate(value)]
        return {"tuple": encoded} if isinstance(value, tuple) else {"list": encoded}
    if value is None or isinstance(value, bool | int | float | str):
        return {"value": value}
    raise TypeError(f"{path}: a {type(value).__name__} is not part of a training state")


def _decode(encoded: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    [(tag, content)] = encoded.items()
    if tag == "tensor":
        return tensors[content]
    if tag == "dict":
        return {key: _decode(item, tensors) for key, item in content}
    if tag in ("list", "tuple"):
        items = [_decode(item, tensors) for item in content]
        return tuple(items) if tag == "tuple" else items
    return content
