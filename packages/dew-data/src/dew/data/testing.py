"""A tiny Hugging Face tokenizer with a chat template, written in a folder, for tests
and examples that must not download one.

:func:`write_chat_tokenizer` trains a byte-level BPE (the ``tokenizers``
library, as GPT-2 and Qwen use) on a few sentences and writes
``tokenizer.json`` and a ``tokenizer_config.json`` whose ``chat_template`` is
ChatML (Qwen's format), with ``<|im_start|>``, ``<|im_end|>`` and
``<|endoftext|>`` as special tokens. Needs the ``[hf]`` extra.
"""

from __future__ import annotations

import json
import os

from dew.data._extra import hf_import

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` a turn."""

CHATML_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML whose assistant text (end-of-turn token included) is a ``{% generation %}`` block."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is two plus two? four. what is one plus one? two.",
    "hello there, how are you today? i am fine, thank you.",
    "user assistant system: answer briefly and kindly.",
]


def write_chat_tokenizer(
    directory: str | os.PathLike, *, template: str = CHATML, vocab_size: int = 300
) -> str:
    """Write a byte-level BPE ``tokenizer.json`` of ``vocab_size`` ids and a
    ``tokenizer_config.json`` (``chat_template`` = ``template``, eos and pad
    ``<|endoftext|>``) into ``directory``; returns the directory, for
    ``HFTokenizer(directory)``."""
    tokenizers = hf_import("tokenizers", needed_by="write_chat_tokenizer")

    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": template,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return os.fspath(directory)
