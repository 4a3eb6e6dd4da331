"""Tokenizers: ``encode(str) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from dew.data._extra import hf_import


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus an end-of-document id, a padding id and a mask id.

    ``vocab_size`` is 264: 256 bytes, ``end_id`` 256, ``pad_id`` 257, ``mask_id``
    258 (the absorbing state of masked diffusion, :mod:`dew.objectives.diffusion.masked`;
    never produced by ``encode``), and unused ids up to a multiple of 8 so the vocab
    axis shards evenly.
    """

    end_id = 256
    pad_id = 257
    mask_id = 258
    vocab_size = 264

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """``encode`` of each text."""
        return [self.encode(text) for text in texts]

    def encode_with_offsets(
        self, text: str, *, add_special_tokens: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text)`` and each id's ``(start, end)`` characters in ``text`` (every
        byte of a character covers that character)."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for index, char in enumerate(text):
            data = char.encode("utf-8")
            ids.extend(data)
            offsets.extend([(index, index + 1)] * len(data))
        return ids, offsets

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __eq__(self, other):
        return type(other) is ByteTokenizer

    def __hash__(self):
        return hash(ByteTokenizer)

    def fingerprint(self) -> str:
        """A string that changes whenever the ids this tokenizer produces would."""
        return "bytes-v1"


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

    path: a ``tokenizer.json`` file, or a directory holding one (with an
      optional ``tokenizer_config.json`` naming the end-of-sequence token).
    add_special_tokens: whether ``encode`` adds the tokenizer's own specials (BOS).
    mask_token: the mask token of masked diffusion (``mask_id``). None = the
      tokenizer's own (``mask_token`` of ``tokenizer_config.json``), if any; a string
      = that token, added to the vocabulary as a special token (the next id,
      ``vocab_size`` grows by one) when the tokenizer lacks it. Build the model with
      ``vocab_size >= tokenizer.vocab_size``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        add_special_tokens: bool = True,
        mask_token: str | None = None,
    ):
        Tokenizer = hf_import("tokenizers", needed_by="HFTokenizer").Tokenizer

        path = os.fspath(path)
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"no tokenizer.json at {file}")
        self.path = file
        try:
            self._tokenizer = Tokenizer.from_file(file)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ValueError(
                f"{file} is not a readable tokenizer.json ({e}; the file is "
                f"{os.path.getsize(file)} bytes): it is damaged or was cut off while being "
                f"saved or downloaded. Download or save the tokenizer again"
            ) from None
        self.add_special_tokens = add_special_tokens
        self.config = {}
        config_file = os.path.join(directory, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file) as f:
                text = f.read()
            try:
                self.config = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{config_file} is not valid JSON: {e.msg} at line {e.lineno}, column "
                    f"{e.colno}. It is damaged or was cut off: download or save the tokenizer "
                    f"again, or delete it (the end and pad tokens are read from it)"
                ) from None
            if not isinstance(self.config, dict):
                raise ValueError(
                    f"{config_file} holds a JSON {type(self.config).__name__}, not an object; "
                    f"download or save the tokenizer again"
                )
        self.end_id = self._special_id("eos_token")
        self.pad_id = self._special_id("pad_token")
        self.mask_token = mask_token
        if mask_token is None:
            self.mask_id = self._special_id("mask_token")
        else:
            if self._tokenizer.token_to_id(mask_token) is None:
                AddedToken = hf_import("tokenizers", needed_by="HFTokenizer").AddedToken
                self._tokenizer.add_special_tokens([AddedToken(mask_token, special=True)])
            self.mask_id = self._tokenizer.token_to_id(mask_token)
            self.config = {**self.config, "mask_token": mask_token}

    def _special_id(self, key: str) -> int | None:
        token = self.config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_with_offsets(
        self, text: str, *, add_special_tokens: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` (the tokenizer's own specials only with
        ``add_special_tokens``) and each id's ``(start, end)`` characters in ``text``:
        how ``transformers`` maps a rendered chat's assistant text to tokens."""
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, [tuple(offset) for offset in encoding.offsets]

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """``encode`` of each text, in parallel inside the ``tokenizers`` library."""
        encodings = self._tokenizer.encode_batch(
            list(texts), add_special_tokens=self.add_special_tokens
        )
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=skip_special_tokens
        )

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` (and ``tokenizer_config.json``) into ``directory``."""
        os.makedirs(directory, exist_ok=True)
        self._tokenizer.save(os.path.join(directory, "tokenizer.json"))
        if self.config:
            with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
                json.dump(self.config, f, indent=2)

    def fingerprint(self) -> str:
        import hashlib

        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            digest.update(f.read())
        digest.update(b"|add_special_tokens=%d" % self.add_special_tokens)
        if self.mask_token is not None:
            digest.update(b"|mask_token=" + self.mask_token.encode("utf-8"))
        return "hf-" + digest.hexdigest()[:16]
