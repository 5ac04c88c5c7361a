"""A value model never starts a tensor from the seed that its checkpoint holds under another name:
:func:`refuse_unread_tensors`, which both engines call when a value model's files lack its head."""

from __future__ import annotations

from pathlib import Path

from underlay.interfaces import CheckpointError
from underlay.interfaces.weightmap import WeightMap

__all__ = ["refuse_unread_tensors"]


def refuse_unread_tensors(path: str | Path, wmap: WeightMap, vocab_rows: int, engine: str) -> None:
    """Raise ``CheckpointError`` when the safetensors of ``path`` hold a tensor that the value model's
    weight map ``wmap`` does not read: a name it neither expects, ties nor ignores, or an ignored
    ``lm_head`` tensor whose first dimension is not the vocabulary's ``vocab_rows`` (so not a causal
    LM's vocabulary head, which a value model drops, but a value head under another name). Called when
    the files lack the value head, which the engine would otherwise initialise from the seed while the
    checkpoint's own head sits under an unread name (``classifier``, ``v_head.summary``, ``lm_head``).
    Reads the file headers only; every rank reads the same and raises alike. ``engine`` names the
    engine in the message."""
    from underlay.utils.safe_files import read_safetensors_dir

    expected = set(wmap.hf_names())
    unread: dict[str, tuple[int, ...]] = {}
    for name, entry in read_safetensors_dir(Path(path)).items():
        if name in expected or name in wmap.tied:
            continue
        shape = tuple(int(d) for d in entry.shape)
        if wmap.is_ignored(name) and ("lm_head" not in name or (shape and shape[0] == vocab_rows)):
            continue
        unread[name] = shape
    if unread:
        raise CheckpointError(
            f"{engine}: value model from {path}: the checkpoint has no score head but holds tensors the "
            f"value model does not read: {dict(sorted(unread.items())[:5])} ({len(unread)} in all; an "
            f"lm_head counts when its first dimension is not the vocabulary's {vocab_rows}); a value head "
            "saved under another name must be renamed to the model's head, 'score.weight' (and "
            "'score.bias'; 'classifier.*' for the GPT-2 family, Falcon and GPT-NeoX); remove "
            "the others, or load a causal-LM checkpoint to start the head from the seed"
        )
