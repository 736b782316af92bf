"""GGUF → Hugging Face folder: config, tokenizer and chat template (`write_gguf_metadata`, the weights stay in
the file), or those with the weights dequantised to fp32 safetensors (`convert_gguf`).

transformers can read a GGUF directly, but dequantising it takes tens of
seconds on every load; converting once into a normal folder makes every later
load a plain safetensors read. The chat template travels in the GGUF's metadata
and is checked after saving, because chat requests are useless without it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from tokenflow.errors import ModelLoadError
from tokenflow.progress import StageBar, on_terminal, quiet_transformers

__all__ = ("convert_gguf", "gguf_chat_template", "sha256_file", "write_gguf_metadata")

CHAT_TEMPLATE_FILE = "chat_template.jinja"

log = logging.getLogger(__name__)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (GGUFs are hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def gguf_chat_template(gguf_path: Path) -> str | None:
    """The `tokenizer.chat_template` string stored in the GGUF, if any."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    return value if isinstance(value, str) and value else None


def convert_gguf(gguf_path: Path, out_dir: Path, bar: StageBar) -> None:
    """Load `gguf_path` with transformers (dequantised to fp32) and save it as an HF folder in `out_dir`.

    Uses the bar's "convert" and "save" stages. Raises ModelLoadError when
    transformers cannot read the file or the saved tokenizer lost its chat template.
    """
    announce_dequantisation(gguf_path)
    with quiet_transformers(not (bar.enabled and on_terminal())):
        _convert(gguf_path, out_dir, bar)


def write_gguf_metadata(gguf_path: Path, out_dir: Path) -> None:
    """The GGUF's config and tokenizer (with its chat template) as an HF folder without weights: the weights
    stay in the file (`runtime/gguf_model.py`)."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        raise ModelLoadError(
            f"transformers could not read the GGUF file {gguf_path}: {exc}. Only GGUF architectures that "
            "transformers supports can be loaded; pass a Hugging Face model folder instead."
        ) from exc
    template = _carry_chat_template(tokenizer, gguf_path)
    config.save_pretrained(out_dir)
    _save_tokenizer(tokenizer, template, out_dir)


def announce_dequantisation(gguf_path: Path) -> None:
    """Say before converting how big the fp32 folder will be: a 4 GB Q4 file becomes ~28 GB on disk
    and in memory while converting, which nobody should find out from a full disk."""
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(str(gguf_path)).tensors
    except Exception as exc:  # transformers' own load reports a broken file more precisely
        log.debug("could not read the tensor list of %s: %s", gguf_path, exc)
        return
    kinds = sorted({t.tensor_type.name for t in tensors})
    fp32_bytes = sum(int(t.n_elements) * 4 for t in tensors)
    file_bytes = gguf_path.stat().st_size
    ratio = fp32_bytes / max(file_bytes, 1)
    level = logging.WARNING if ratio > 1.5 else logging.INFO
    log.log(level, "%s holds %s weights (%.1f MiB); tokenflow dequantises them to fp32 once: the converted "
            "folder will take about %.1f MiB (%.1fx the file) and as much memory while converting",
            gguf_path.name, "/".join(kinds), file_bytes / 2**20, fp32_bytes / 2**20, ratio)


def _convert(gguf_path: Path, out_dir: Path, bar: StageBar) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    with bar.stage("convert"):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder,
                gguf_file=name,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
            )
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as exc:
            raise ModelLoadError(
                f"transformers could not load the GGUF file {gguf_path}: {exc}. "
                "Only GGUF architectures that transformers supports can be converted; "
                "pass a Hugging Face model folder instead."
            ) from exc
        _detach_quantizer(model, torch.float32)
        template = _carry_chat_template(tokenizer, gguf_path)

    with bar.stage("save"):
        model.save_pretrained(out_dir)
        del model
        _save_tokenizer(tokenizer, template, out_dir)


def _carry_chat_template(tokenizer: Any, gguf_path: Path) -> str | None:
    """The chat template, set on `tokenizer` from the GGUF's metadata where transformers' loader dropped it."""
    template = tokenizer.chat_template or gguf_chat_template(gguf_path)
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    return template


def _save_tokenizer(tokenizer: Any, template: str | None, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    if template:
        _ensure_chat_template(out_dir, template)


def _detach_quantizer(model: Any, dtype: Any) -> None:
    """Make the dequantised model saveable as a plain fp32 checkpoint.

    With `dequantize=True` transformers drops its GGUF quantizer itself; older
    loader paths leave it attached although every weight is already dense, and
    `save_pretrained` then refuses. Only detach it after checking that no weight
    is still packed, so a packed model can never be saved as garbage.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    packed = [name for name, param in model.named_parameters() if param.dtype != dtype]
    if packed:
        raise ModelLoadError(
            f"transformers kept {len(packed)} GGUF weights packed (e.g. {packed[0]}); tokenflow can only "
            "convert fully dequantised models."
        )
    quantizer.remove_quantization_config(model)


def _ensure_chat_template(out_dir: Path, template: str) -> None:
    """Reload the saved tokenizer and make sure the template survived; write it out if not."""
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(out_dir).chat_template == template:
        return
    log.warning("saved tokenizer lost its chat template; writing %s explicitly", CHAT_TEMPLATE_FILE)
    (out_dir / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    if AutoTokenizer.from_pretrained(out_dir).chat_template != template:
        raise ModelLoadError(
            f"the converted tokenizer in {out_dir} does not keep the GGUF's chat template; "
            "this transformers version saves tokenizers differently than tokenflow expects."
        )
