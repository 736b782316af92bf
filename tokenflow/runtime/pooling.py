"""How `Engine.embed` turns a sequence's final hidden states into one vector.

A sentence-transformers folder says it in its own files (`modules.json` lists a `Pooling` module, whose
`config.json` names the mode, and a `Normalize` module where the vectors are unit length); other models get
what embedding models built on decoders use (last-token pooling, unit length), as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenflow.errors import InvalidRequest

__all__ = ("POOLING_MODES", "Pooling", "pool", "pooling_for")

POOLING_MODES: tuple[str, ...] = ("last", "mean", "cls", "max")
# sentence-transformers' Pooling config keys, by the mode each switches on
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_max_tokens": "max"}
_ST_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls", "max": "max"}


@dataclass(frozen=True, slots=True)
class Pooling:
    mode: str = "last"  # one of POOLING_MODES (a folder may name another: refused by `pool`)
    normalize: bool = True


def pooling_for(folder: str | Path | None) -> Pooling:
    """The model folder's own pooling (sentence-transformers' modules), else last-token and unit length."""
    modules_file = Path(folder) / "modules.json" if folder is not None else None
    if modules_file is None or not modules_file.is_file():
        return Pooling()
    try:
        modules = json.loads(modules_file.read_text())
        types = [str(m.get("type", "")) for m in modules]
        pooling_path = next(Path(folder) / m.get("path", "") for m in modules  # type: ignore[arg-type]
                            if str(m.get("type", "")).endswith("Pooling"))
        config = json.loads((pooling_path / "config.json").read_text())
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return Pooling()
    named = config.get("pooling_mode")  # sentence-transformers 6 names the mode; earlier ones flag it
    if isinstance(named, str):
        mode = _ST_NAMES.get(named, named)  # a mode tokenflow lacks is refused when `embed` is called
    else:
        mode = next((name for key, name in _ST_MODES.items() if config.get(key)), "last")
    return Pooling(mode=mode, normalize=any(t.endswith("Normalize") for t in types))


def pool(hidden: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """One vector `[hidden]` from a sequence's `[len, hidden]` final hidden states."""
    if pooling.mode == "last":
        vector = hidden[-1]
    elif pooling.mode == "cls":
        vector = hidden[0]
    elif pooling.mode == "mean":
        vector = hidden.mean(0)
    elif pooling.mode == "max":
        vector = hidden.max(0).values
    else:
        raise InvalidRequest(f"pooling {pooling.mode!r} is not one tokenflow computes ({', '.join(POOLING_MODES)}); "
                             "pass `pooling`", field="pooling")
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector
