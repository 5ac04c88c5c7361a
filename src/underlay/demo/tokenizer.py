"""A character-level tokenizer built locally with the ``tokenizers`` library (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

from underlay.data.arithmetic import ALPHABET

__all__ = ["CHAT_SPECIALS", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_tokenizer", "train_chat_tokenizer"]

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


CHAT_SPECIALS = ("<pad>", "<bos>", "<|end|>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
"""Special tokens of :func:`train_chat_tokenizer` (ids 0..7): ``<|end|>`` ends every turn and is the
eos; the role markers open turns."""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Jinja chat template of :func:`train_chat_tokenizer`: ``<|role|>content<|end|>`` per message, then
``<|assistant|>`` as the generation prompt. Special tokens delimit every turn, so tokenizing a
conversation turn by turn gives the ids of the whole."""


def train_chat_tokenizer(corpus: list[str], vocab_size: int = 64) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` whose BPE vocabulary (at most ``vocab_size``
    entries, specials included) is trained on ``corpus`` by the ``tokenizers`` library, with
    :data:`CHAT_SPECIALS`, :data:`CHAT_TEMPLATE`, eos ``<|end|>``, pad ``<pad>`` and left padding.
    Words are split on spaces (Metaspace ``▁``), so frequent words become single tokens. No BOS is
    added (the template starts with a role marker). Deterministic for a given corpus."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    fast: Any = transformers.PreTrainedTokenizerFast
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(CHAT_SPECIALS), show_progress=False
    )
    core.train_from_iterator(corpus, trainer=trainer)
    return fast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<|end|>",
        unk_token="<unk>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
    )
