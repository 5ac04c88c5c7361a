"""LoRA pieces both engines share: peft's config and module selection for a ``LoraConfig``, reading a
peft adapter directory, and writing one.

Both engines adapt exactly the modules peft adapts for a ``LoraConfig`` on the Hugging Face model
(``adapted_modules``: peft's own matching of ``target_modules``, ``"all-linear"`` and
``exclude_modules``), start from the same initial adapters (peft's initialisation inside the seeded
build) and read and write peft's adapter directory layout (``adapter_config.json`` +
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from underlay.interfaces import CheckpointError, ConfigError, LoraConfig

__all__ = [
    "PEFT_PREFIX",
    "adapted_modules",
    "adapter_file_tensors",
    "adapter_tensors",
    "add_lora",
    "check_adapter_dir",
    "export_adapter_dir",
    "peft_lora_config",
]

PEFT_PREFIX = "base_model.model."
"""peft's prefix of every module name of a ``PeftModel`` (and of every tensor name it saves)."""


def peft_lora_config(lora: LoraConfig) -> Any:
    """peft's ``LoraConfig`` for ``lora`` (plain LoRA: no bias, no rsLoRA or DoRA). ``ConfigError``
    when peft is not installed."""
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError as exc:
        raise ConfigError("ModelConfig.lora needs peft: pip install 'underlay[hf]'") from exc
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    excl = lora.exclude_modules if isinstance(lora.exclude_modules, str) else list(lora.exclude_modules)
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=targets,
        exclude_modules=excl or None,
        bias="none",
    )


def add_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """``model`` wrapped by peft's ``get_peft_model`` with ``lora``'s adapters (initialised by peft from
    the global RNG: A random, B zero). ``ConfigError`` when peft finds no module to adapt."""
    from peft import get_peft_model

    cfg = peft_lora_config(lora)
    try:
        peft_model: torch.nn.Module = get_peft_model(model, cfg)
        return peft_model
    except ValueError as exc:
        raise ConfigError(
            f"LoraConfig.target_modules={lora.target_modules} (exclude_modules={lora.exclude_modules}): {exc}; "
            "name linear layers of the model"
        ) from exc


def adapted_modules(peft_model: torch.nn.Module) -> tuple[str, ...]:
    """The Hugging Face module names (without peft's ``base_model.model.`` prefix) that carry LoRA
    adapters in ``peft_model``, sorted."""
    names = set()
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            names.add(name.removeprefix(PEFT_PREFIX))
    return tuple(sorted(names))


def check_adapter_dir(lora: LoraConfig) -> tuple[Path, dict[str, Any]]:
    """The adapter directory of ``lora.adapter_path`` and its ``adapter_config.json``, after checking
    that rank, alpha and targets equal ``lora``'s. ``ConfigError`` naming the difference or the missing
    file (before anything is built)."""
    assert lora.adapter_path is not None
    root = Path(lora.adapter_path)
    cfg_file, weights = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise ConfigError(
            f"LoraConfig.adapter_path={lora.adapter_path!r}: needs adapter_config.json and "
            "adapter_model.safetensors (peft's save_pretrained / export_adapters layout)"
        )
    data = json.loads(cfg_file.read_text())
    file_targets = data.get("target_modules") or ()
    file_targets = file_targets if isinstance(file_targets, str) else tuple(sorted(file_targets))
    mine = lora.target_modules if isinstance(lora.target_modules, str) else tuple(sorted(lora.target_modules))
    diff = {
        k: (a, b)
        for k, a, b in (
            ("rank", lora.rank, data.get("r")),
            ("alpha", float(lora.alpha), float(data.get("lora_alpha", -1))),
            ("target_modules", mine, file_targets),
        )
        if a != b
    }
    if diff and not (set(diff) == {"target_modules"} and mine == "all-linear"):
        text = ", ".join(f"{k}: config {a!r} vs file {b!r}" for k, (a, b) in diff.items())
        raise ConfigError(
            f"LoraConfig.adapter_path={lora.adapter_path!r} differs from the LoraConfig ({text}); "
            "build it with LoraConfig.from_adapter(path)"
        )
    return root, data


def adapter_file_tensors(lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The tensors of ``lora.adapter_path``'s ``adapter_model.safetensors`` under the names peft saves
    (``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``), after ``check_adapter_dir``.
    ``CheckpointError`` for a tensor that is not a LoRA A/B weight."""
    from safetensors.torch import load_file

    root, _ = check_adapter_dir(lora)
    out = load_file(str(root / "adapter_model.safetensors"))
    for name in out:
        if not re.search(r"\.lora_[AB]\.weight$", name):
            raise CheckpointError(
                f"LoraConfig.adapter_path={lora.adapter_path!r}: tensor {name!r} is not a LoRA A/B weight of a "
                "linear layer (the engines adapt linear layers only)"
            )
    return out


def adapter_tensors(lora: LoraConfig) -> dict[str, torch.Tensor]:
    """``adapter_file_tensors`` under the live parameter names of a peft model (peft's saved
    ``...lora_A.weight`` is the live ``...lora_A.default.weight``)."""
    return {
        re.sub(r"\.(lora_[AB])\.weight$", r".\1.default.weight", name): t
        for name, t in adapter_file_tensors(lora).items()
    }


def export_adapter_dir(engine: Any, out_dir: str | Path, peft_config: Any) -> Path | None:
    """``WeightLoader.export_adapters`` for either engine: every rank gathers
    ``engine.named_adapter_tensors()`` (peft's saved names), then rank 0 writes them and
    ``peft_config``'s ``adapter_config.json`` into ``out_dir`` atomically (the whole directory appears
    at once; an earlier export there is replaced, anything else at ``out_dir`` is refused and left as
    it is, see ``utils.safe_files``). A failed write raises ``CheckpointError`` on every rank.
    Collective; returns the directory on rank 0, ``None`` elsewhere."""
    from safetensors.torch import save_file

    from underlay.engines._hf_export import export_owned
    from underlay.parallel.agree import agree, describe
    from underlay.parallel.rank import current_rank
    from underlay.utils.safe_files import as_path, atomic_directory

    out = as_path(out_dir, "export_adapters: out_dir")
    tensors = {n: t.detach().cpu().contiguous() for n, t in engine.named_adapter_tensors()}
    error: BaseException | None = None
    if current_rank() == 0:
        try:
            with atomic_directory(out, replaceable=export_owned) as tmp:
                save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
                peft_config.save_pretrained(str(tmp))
        except Exception as exc:
            error = exc
    agree(
        error is None,
        describe(error),
        what=f"export_adapters({out})",
        error_type=CheckpointError,
        cause=error,
    )
    return out if current_rank() == 0 else None
