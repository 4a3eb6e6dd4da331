"""The logical axis vocabulary of Dew.

Every parameter and every constrained activation in Dew names its dimensions
with these words, and only these. The trainer's rules table (``dew.train``)
maps each name to mesh axes; model code never names a mesh axis. Adding a
name is an API change.
"""

BATCH = "batch"  # examples in a batch
LENGTH = "length"  # token (or patch) positions in a sequence
EMBED = "embed"  # the residual stream's features
HEADS = "heads"  # query heads
KV_HEADS = "kv_heads"  # key/value heads (grouped-query attention)
HEAD_DIM = "head_dim"  # features inside one head
MLP = "mlp"  # hidden features of the feed-forward block
VOCAB = "vocab"  # token ids
EXPERT = "expert"  # experts of a mixture-of-experts block
LAYERS = "layers"  # the stacked layer axis of a scanned block
# images and video
HEIGHT = "height"
WIDTH = "width"
FRAMES = "frames"
CHANNELS = "channels"

VOCABULARY = (
    BATCH,
    LENGTH,
    EMBED,
    HEADS,
    KV_HEADS,
    HEAD_DIM,
    MLP,
    VOCAB,
    EXPERT,
    LAYERS,
    HEIGHT,
    WIDTH,
    FRAMES,
    CHANNELS,
)
"""Every logical axis name Dew uses, in one place."""
