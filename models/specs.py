"""Job specifications: everything that decides an output, and the hash that names it."""

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# "auto": whatever suits the device that does the work, decided there (workers/gpu.py):
# half precision on a GPU, float32 on the CPU, where half precision crawls or fails.
AUTO_DTYPE = "auto"
DTYPES = ("float16", "bfloat16", "float32", AUTO_DTYPE)
SPEC_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class ModelIdentity:
    """A model as resolved at submit time: a name for people, a revision for machines."""

    name: str
    source: str  # tiny | /local/folder | s3://bucket/prefix | store:models/<name>/<rev> | hub:<id>
    revision: str  # content hash or hub commit: what makes two renders comparable
    scheduler: str
    scheduler_config: dict[str, Any]
    default_dtype: str
    default_size: int
    # The hash of its VAE, text encoder and tokenizer files, where known: latents made by
    # another model with the same encoders are the ones this one would make.
    encoders_hash: str | None = None


# Canonical JSON: sorted keys, no spaces, UTF-8 text as it is.
canonical_json = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode


def canonical_sha256(value: Any) -> str:
    """sha256 of a value's canonical JSON."""
    return _sha256(canonical_json(value))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class CanonicalTemplate:
    """canonical_sha256 of many dicts that differ only in a few keys' values, for a submit's
    100,000 specs that share all but their prompt and seed: the rest is encoded once, and
    each hash joins that text around the encodings of the values that vary.

    The bytes are canonical_json's: a dict's canonical JSON is its `"key":value` pieces in
    key order, so a template made from any dict with the same keys, rendered with that
    dict's varying values, is that dict's canonical JSON (tests/test_plan.py checks it).
    """

    def __init__(self, example: dict[str, Any], varying: Iterable[str]) -> None:
        self.varying = sorted(varying)
        # Literal text before, between and after the varying values.
        self.texts = ["{"]
        for position, key in enumerate(sorted(example)):
            self.texts[-1] += ("," if position else "") + canonical_json(key) + ":"
            if key in self.varying:
                self.texts.append("")
            else:
                self.texts[-1] += canonical_json(example[key])
        self.texts[-1] += "}"

    def sha256(self, values: dict[str, Any]) -> str:
        parts = [self.texts[0]]
        for key, text in zip(self.varying, self.texts[1:], strict=True):
            parts += (canonical_json(values[key]), text)
        return _sha256("".join(parts))
