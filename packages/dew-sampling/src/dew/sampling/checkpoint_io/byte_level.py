"""Dew's :class:`~dew.data.ByteTokenizer` written as a Hugging Face ``tokenizer.json``.

A Hugging Face checkpoint has no place for Dew's byte tokenizer, so
:meth:`dew.sampling.Pretrained.save` writes an equivalent one with the
``tokenizers`` library: a byte-level BPE without merges whose token ``b`` is
byte ``b`` (GPT-2's byte-to-character table names the bytes), followed by the
byte tokenizer's special ids: ``<|dew_end|>`` = ``end_id`` (256),
``<|dew_pad|>`` = ``pad_id`` (257), and unused ids up to ``vocab_size``.
transformers and :class:`~dew.data.HFTokenizer` read it and produce the same
ids as ``ByteTokenizer`` (except for text that spells a special token's name).
"""

from __future__ import annotations

import json
import os
import pathlib

from dew.data import ByteTokenizer

END, PAD = "<|dew_end|>", "<|dew_pad|>"


def byte_characters() -> dict[int, str]:
    """GPT-2's reversible table from the 256 bytes to printable characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def save_byte_tokenizer(tokenizer: ByteTokenizer, directory: str | os.PathLike) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` equivalent to ``tokenizer``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in byte_characters().items()}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    unused = [f"<|dew_unused_{i}|>" for i in range(tokenizer.vocab_size - 258)]
    hf.add_special_tokens([AddedToken(t, special=True) for t in [END, PAD, *unused]])
    if (hf.token_to_id(END), hf.token_to_id(PAD)) != (tokenizer.end_id, tokenizer.pad_id):
        raise AssertionError("the byte tokenizer's special ids moved; update byte_level.py")
    directory = pathlib.Path(directory)
    hf.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END,
        "pad_token": PAD,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
