"""dew.data: datasets as two iterator factories, partitions, tokenizers and readers."""

from dew.data.dataset import Batch, Dataset, Partition
from dew.data.tokenizers import ByteTokenizer, HFTokenizer

__version__ = "0.1.0"

__all__ = ["Batch", "ByteTokenizer", "Dataset", "HFTokenizer", "Partition"]
