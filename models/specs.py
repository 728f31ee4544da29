"""Job specifications: everything that decides an output, and the hash that names it."""

import hashlib
import json
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
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
    # The train run and step that made it (a checkpoint), where a run did.
    made_by: tuple[int, int] | None = None


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


@dataclass(frozen=True)
class Declared:
    """What a run option takes and what the command line says of it (see `option`)."""

    help: str
    low: float | None = None
    high: float | None = None
    above: bool = False  # low itself is not allowed
    below: bool = False  # high itself is not allowed
    choices: tuple[str, ...] = ()
    # 0 on the command line means None ("no EMA", "no clipping"): the option's default shows
    # as the field's, or 0.
    zero_is_none: bool = False
    # What None means, said as the option's default ("every one").
    shown: str | None = None

    def refusal(self, flag: str, value: Any) -> str | None:
        """Why `value` is not one this option takes, or None."""
        if value is None:
            return None
        if self.choices and value not in self.choices:
            return f"{flag} must be one of {', '.join(self.choices)}, got {value!r}"
        low, high = self.low, self.high
        too_low = low is not None and (value <= low if self.above else value < low)
        too_high = high is not None and (value >= high if self.below else value > high)
        if too_low or too_high:
            return f"{flag} must be {self.range()}, got {value}"
        return None

    def range(self) -> str:
        """The values it takes, in words: "above 0 and below 1"."""
        low = high = ""
        if self.low is not None:
            low = f"{'above' if self.above else 'at least'} {self.low:g}"
        if self.high is not None:
            high = f"{'below' if self.below else 'at most'} {self.high:g}"
        return " and ".join(part for part in (low, high) if part)


def option(default: Any = MISSING, **declared: Any) -> Any:
    """An option of a kind's runs, declared once: its default, the values it takes and its
    help (Declared); the command line builds its option from it (producer/cli/options.py),
    and `refuse_undeclared` checks a value against it."""
    return field(default=default, metadata={"option": Declared(**declared)})


def refuse_undeclared(options: Any) -> None:
    """Raises ValueError naming the first option whose value its declaration does not take."""
    for declared in fields(options):
        if "option" in declared.metadata:
            flag = "--" + declared.name.replace("_", "-")
            refusal = declared.metadata["option"].refusal(flag, getattr(options, declared.name))
            if refusal is not None:
                raise ValueError(refusal)
