"""dew.data: datasets as two iterator factories, partitions, tokenizers and Grain readers.

A :class:`Dataset` states its batch spec, ``{key: Field(shape, dtype)}`` per
row, which each reader fills in from its arguments.

Readers describe a dataset and build a :class:`Dataset` with ``.load(batch=...)``:
:class:`TokenWindows` (text for language models), :class:`HFImages` (images of
the ``datasets`` library), :class:`Videos` (local clips), :class:`PreferencePairs`
(DPO), :class:`Prompts` (GRPO, PPO) and :class:`SFTExamples` (supervised
fine-tuning on prompt/completion or chat rows, rendered with a
:class:`ChatTemplate`, packed or not) and :class:`TeacherTopK` (a teacher's top-k
log-probs stored once by :class:`TopKWriter`, for offline distillation).
:class:`Mixture` mixes readers' examples by weight (a schedule may change the
weights at given steps); :class:`ParquetStream` streams a ``datasets`` repository's
parquet shards row group by row group. :func:`from_records` turns any
random-access source into a Grain-backed :class:`Dataset` the same way.
"""

from dew.data.chat_template import ChatTemplate, ChatTemplateError
from dew.data.dataset import Batch, Dataset, Field, Partition, spec_of_batch
from dew.data.images import HFImages
from dew.data.mixture import Mixture
from dew.data.parquet_stream import ParquetStream
from dew.data.preferences import PreferencePairs
from dew.data.prompts import Prompts
from dew.data.records import RecordError, Records, from_records
from dew.data.sft import SFTExamples
from dew.data.teacher_topk import TeacherTopK, TopKWriter
from dew.data.token_windows import TokenWindows
from dew.data.tokenizers import ByteTokenizer, HFTokenizer
from dew.data.videos import Videos

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateError",
    "Dataset",
    "Field",
    "HFImages",
    "HFTokenizer",
    "Mixture",
    "ParquetStream",
    "Partition",
    "PreferencePairs",
    "Prompts",
    "RecordError",
    "Records",
    "SFTExamples",
    "TeacherTopK",
    "TokenWindows",
    "TopKWriter",
    "Videos",
    "from_records",
    "spec_of_batch",
]
