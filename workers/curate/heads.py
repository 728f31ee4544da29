"""Scoring heads on a CLIP image embedding, loaded from their published state dicts as they
are: a stack of linear layers keyed `layers.<i>.weight` and `.bias` (safetensors, or torch's
own .pth/.pt/.bin read with weights_only). LAION's improved aesthetic predictor is
Linear(D, 1024), Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout,
Linear(64, 16), Linear(16, 1) (keys layers.0, 2, 4, 6, 7) with no activations, applied to
the L2-normalised embedding; an NSFW head is linear layers with ReLU between and a sigmoid
at the end (LAION's CLIP-based detector). GPU-side: imports torch.

    python -m sdq.workers.curate.heads FILE
prints the head's layer widths as JSON: the CLI checks a head against the CLIP model so,
without loading torch itself.
"""

import io
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from sdq.models.curate.specs import HEAD_LAYER


class BadHead(Exception):
    """Not a head sdq can read: its keys or shapes are not a stack of linear layers."""


def read_head(data: bytes, name: str) -> dict[str, torch.Tensor]:
    """A head's state dict from its file's bytes (`name` says which format)."""
    if name.endswith(".safetensors"):
        return load_safetensors(data)
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise BadHead(f"{name}: not a state dict")
    return state


def linear_layers(state: dict[str, torch.Tensor], name: str) -> list[torch.nn.Linear]:
    """The head's linear layers in order, each input as wide as the one before's output."""
    indices = sorted({int(match[1]) for key in state if (match := HEAD_LAYER.fullmatch(key))})
    if not indices or set(state) != {f"layers.{i}.{part}" for i in indices
                                     for part in ("weight", "bias")}:  # fmt: skip
        raise BadHead(f"{name}: expected linear layers keyed layers.<i>.weight and .bias")
    layers = []
    for index in indices:
        weight, bias = state[f"layers.{index}.weight"], state[f"layers.{index}.bias"]
        if weight.ndim != 2 or bias.shape != weight.shape[:1]:
            raise BadHead(f"{name}: layers.{index} is not a linear layer")
        if layers and layers[-1].out_features != weight.shape[1]:
            raise BadHead(f"{name}: layers.{index} takes {weight.shape[1]} inputs, "
                          f"the layer before gives {layers[-1].out_features}")  # fmt: skip
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
        layer.load_state_dict({"weight": weight, "bias": bias})
        layers.append(layer)
    if layers[-1].out_features != 1:
        raise BadHead(f"{name}: its last layer gives {layers[-1].out_features} outputs, not 1")
    return layers


def aesthetic_head(state: dict[str, torch.Tensor], name: str) -> torch.nn.Module:
    """A score, about 1 to 10, of an L2-normalised embedding."""
    return torch.nn.Sequential(*linear_layers(state, name))


def nsfw_head(state: dict[str, torch.Tensor], name: str) -> torch.nn.Module:
    """A probability of an L2-normalised embedding."""
    layers: list[torch.nn.Module] = []
    for layer in linear_layers(state, name):
        layers += [layer, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1], torch.nn.Sigmoid())


def widths(path: Path) -> list[int]:
    """Each layer's input width, then the last one's output width."""
    layers = linear_layers(read_head(path.read_bytes(), path.name), str(path))
    return [layer.in_features for layer in layers] + [layers[-1].out_features]


def main(path: str) -> None:
    try:
        print(json.dumps({"widths": widths(Path(path))}))
    except (BadHead, OSError, RuntimeError, ValueError) as error:
        print(json.dumps({"error": str(error)}))


if __name__ == "__main__":
    main(sys.argv[1])
