"""A tiny word-level tokenizer built offline, so synthetic checkpoints load with ``AutoTokenizer``.

Ids 0..3 are ``<pad>``, ``<s>``, ``</s>``, ``<unk>`` (matching the synthetic configs' pad / bos / eos
ids); the rest are lower-case words split on whitespace. Built with the ``tokenizers`` library
(``WordLevel`` model), wrapped in transformers' ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

_WORDS = (
    "the a an and or of to in on at is are was were be it this that with for from by as not no yes "
    "red green blue black white cat dog bird fish tree river stone cloud rain sun moon star light dark "
    "one two three four five six seven eight nine ten up down left right big small old new fast slow"
).split()


def vocabulary(vocab_size: int) -> dict[str, int]:
    """Token → id for ``vocab_size`` tokens: the specials, the word list, then ``w<N>`` fillers.

    Raises:
        ValueError: ``vocab_size`` is smaller than the number of special tokens + 1.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} too small; need > {len(SPECIAL_TOKENS)}")
    tokens = list(SPECIAL_TOKENS) + list(_WORDS)
    tokens += [f"w{i}" for i in range(max(0, vocab_size - len(tokens)))]
    return {tok: i for i, tok in enumerate(tokens[:vocab_size])}


def save_tokenizer(out_dir: str | Path, vocab_size: int) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` for a word-level tokenizer to ``out_dir``.

    ``AutoTokenizer.from_pretrained(out_dir)`` loads it; ``decode`` joins words with spaces.
    Returns ``out_dir``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocabulary(vocab_size), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins word-level tokens with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(out_dir))
    return Path(out_dir)
