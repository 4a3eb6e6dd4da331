"""Checkpoint I/O of inference models: safetensors directories (:mod:`.files`), the
Hugging Face and Dew formats on disk (:mod:`.formats`), Dew's byte tokenizer as a
``tokenizer.json`` (:mod:`.byte_level`) and :class:`Pretrained` (:mod:`.pretrained`),
which loads any of them and saves it back in the format it came in. (Training runs'
checkpoints, Orbax, are :class:`dew.train.Checkpoints`.)

``Pretrained`` is imported when first asked for: the pipelines it builds read and
write through :mod:`.formats`, so importing this package must not import them."""

from dew.sampling.checkpoint_io import byte_level, files, formats
from dew.sampling.checkpoint_io.files import TensorReader, write_tensors

__all__ = ["Pretrained", "TensorReader", "byte_level", "files", "formats", "write_tensors"]


def __getattr__(name: str):
    if name == "Pretrained":
        from dew.sampling.checkpoint_io.pretrained import Pretrained

        return Pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
