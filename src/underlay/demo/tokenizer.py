"""A character-level tokenizer built locally with the ``tokenizers`` library (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

from underlay.data.arithmetic import ALPHABET

__all__ = ["SPECIAL_TOKENS", "build_tokenizer"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
"""Ids 0..3, in this order."""


def build_tokenizer(alphabet: str = ALPHABET) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` with one token per character of ``alphabet`` (ids
    4..), the specials of :data:`SPECIAL_TOKENS` (``pad=0, bos=1, eos=2, unk=3``), ``<bos>`` prepended on
    encode, left padding (for generation) and lossless decode of non-special tokens. Deterministic: the
    same alphabet gives the same ids. ``save_pretrained`` writes files that ``AutoTokenizer`` loads."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, processors

    fast: Any = transformers.PreTrainedTokenizerFast

    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(chars)})
    # BPE without merges splits a word into characters; with no pre-tokenizer the whole text is one word.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return fast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
