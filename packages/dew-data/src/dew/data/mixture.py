"""``Mixture``: the examples of several readers in one stream, by weights that may
change at given steps.

Selection is Grain's weighted interleave (``grain.MapDataset.mix``): with
integer proportions ``p`` (the weights scaled to ``2**20`` in all), position
``k`` of the mixed stream goes to the source whose count among the first
``k + 1`` positions exceeds its count among the first ``k``, where the count
of source ``i`` among ``n`` positions is ``n_i - floor(n_i (R_i - p_i) / R_i)``
(``R_i`` the proportions of sources ``i`` onward, ``n_i`` the positions they
share). Every prefix of the stream then holds each source within one example
of its weight, and position ``k``'s source and its index within the source are
computed, not replayed. A schedule starts each stage's interleave afresh at its
step, each source continuing where the previous stages left it.

Source ``s``'s examples are its training rows shuffled anew each epoch from the
reader's own ``seed`` (as :func:`dew.data.from_records` shuffles them), so a
one-source mixture reads exactly what the reader alone reads. A source that runs
out starts its next epoch (``exhausted="repeat"``, epochs counted per source) or
ends the training stream at the last batch it can fill (``"stop"``).

Global batch ``g`` is positions ``g * batch ... (g + 1) * batch - 1``; a process
reads its contiguous rows of it, as every reader does. The training iterator's
position (``get_state``) records the step, each source's position and epoch,
the weights in force and the schedule; a checkpoint whose sources' positions
the configured schedule does not reproduce (a stage before it was changed) is
an error on restore rather than a silently different stream.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dew.data.dataset import Batch, Dataset, Field, Partition
from dew.data.records import (
    EpochOrder,
    RecordReader,
    SkipCount,
    check_batch,
    one_pass,
    rows_of,
)

logger = logging.getLogger("dew.data")

EXHAUSTED = ("repeat", "stop")
_SCALE = 2**20  # the weights of a stage become integer proportions summing to about this


def proportions(weights: Sequence[float]) -> tuple[int, ...]:
    """Integer proportions of ``weights`` (a positive sum), summing to about ``2**20``."""
    total = float(sum(weights))
    return tuple(int(round(w / total * _SCALE)) for w in weights)


def interleave_counts(n: np.ndarray, parts: Sequence[int]) -> np.ndarray:
    """How many of the first ``n`` positions of Grain's weighted interleave with integer
    proportions ``parts`` go to each source: int64 ``[len(n), len(parts)]``."""
    current = np.asarray(n, np.int64).copy()
    remaining = int(sum(parts))
    out = np.zeros((current.shape[0], len(parts)), np.int64)
    for i, part in enumerate(parts):
        if remaining == 0:
            break
        rest = (current * (remaining - part)) // remaining
        out[:, i] = current - rest
        remaining -= part
        current = rest
    return out


def _check_weights(weights: Any, names: Sequence[str], *, what: str) -> dict[str, float]:
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{what} must be a dict of source name -> weight, got {type(weights).__name__}"
        )
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"{what} names {unknown}, which are not sources; the sources are {names}")
    out = {}
    for name in names:
        value = weights.get(name, 0.0)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{what}[{name!r}] must be a number, got {value!r}") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"{what}[{name!r}] is {value}; weights must be finite and >= 0 (0 leaves the "
                f"source out)"
            )
        out[name] = value
    if sum(out.values()) <= 0:
        raise ValueError(f"{what} are all zero ({out}); give at least one source a positive weight")
    return out


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Several readers' training examples mixed by weight, as one :class:`Dataset`.

    sources: name -> reader (:class:`TokenWindows`, :class:`SFTExamples`, any
      reader with ``splits()``); every source's examples have the same keys,
      shapes and dtypes.
    weights: name -> weight (>= 0, at least one positive; normalised, so
      ``{"web": 7, "code": 3}`` is 70% and 30%); a source left out has weight 0.
    schedule: ``(step, weights)`` pairs, steps strictly increasing and > 0: from
      global batch ``step`` on, ``weights`` replace the previous ones. Empty =
      ``weights`` throughout.
    exhausted: what a source that has handed out all its training examples does:
      ``"repeat"`` (a new epoch, reshuffled; epochs are counted per source) or
      ``"stop"`` (the training stream ends with the last batch every source can
      fill).
    skip_errors: skip unreadable records, as :func:`dew.data.from_records` does.
    read_threads: Grain threads reading batches ahead (0 = in the caller's thread).
    prefetch: batches read ahead.

    Validation (``val``) is one pass over each source's validation examples in
    turn, in the order of ``sources``, each source's last batch padded
    (``example_mask``).
    """

    sources: Mapping[str, Any]
    weights: Mapping[str, float]
    _: dataclasses.KW_ONLY
    schedule: Sequence[tuple[int, Mapping[str, float]]] = ()
    exhausted: str = "repeat"
    skip_errors: bool = False
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        if not isinstance(self.sources, Mapping) or not self.sources:
            raise ValueError(
                f"Mixture.sources must be a non-empty dict of name -> reader, got {self.sources!r}"
            )
        for name, reader in self.sources.items():
            if not callable(getattr(reader, "splits", None)):
                raise TypeError(
                    f"Mixture source {name!r} is a {type(reader).__name__}, which has no "
                    f"splits(); give a dew.data reader (TokenWindows, SFTExamples, ...)"
                )
        names = list(self.sources)
        _check_weights(self.weights, names, what="Mixture.weights")
        previous = 0
        for index, entry in enumerate(self.schedule):
            try:
                step, weights = entry
            except (TypeError, ValueError):
                raise TypeError(
                    f"Mixture.schedule[{index}] must be a (step, weights) pair, got {entry!r}"
                ) from None
            if not isinstance(step, int) or step <= previous:
                raise ValueError(
                    f"Mixture.schedule steps must be integers, strictly increasing and > 0; "
                    f"entry {index} has step {step!r} after {previous}"
                )
            _check_weights(weights, names, what=f"Mixture.schedule[{index}] weights")
            previous = step
        if self.exhausted not in EXHAUSTED:
            raise ValueError(
                f"Mixture.exhausted must be one of {EXHAUSTED} (a source that runs out starts "
                f"a new epoch, or ends the stream), got {self.exhausted!r}"
            )
        if self.read_threads < 0 or self.prefetch < 0:
            raise ValueError(
                f"Mixture.read_threads and prefetch must be >= 0, got {self.read_threads} "
                f"and {self.prefetch}"
            )

    @property
    def stages(self) -> list[tuple[int, dict[str, float]]]:
        """``(first step, weights)`` of every stage, the first at step 0."""
        names = list(self.sources)
        stages = [(0, self.weights), *self.schedule]
        return [(step, _check_weights(w, names, what="weights")) for step, w in stages]

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` mixed examples per global batch."""
        if batch < 1:
            raise ValueError(f"Mixture: batch must be >= 1 examples, got {batch}")
        names = list(self.sources)
        splits = {name: reader.splits() for name, reader in self.sources.items()}
        spec = _common_spec({name: train.spec for name, (train, _) in splits.items()})
        for name, (train, _) in splits.items():
            if len(train) < 1:
                raise ValueError(f"Mixture source {name!r} has no training examples")
        plan = _Plan(
            self.stages,
            sizes=[len(splits[name][0]) for name in names],
            batch=batch,
            stop=self.exhausted == "stop",
        )
        if plan.steps == 0:
            raise ValueError(
                f"Mixture: with exhausted='stop' not even one global batch of {batch} fills "
                f"before a source runs out (training examples per source "
                f"{dict(zip(names, plan.sizes, strict=True))}); use a smaller batch or "
                f"exhausted='repeat'"
            )
        if self.exhausted == "stop":
            logger.info(
                "Mixture: exhausted='stop' ends the training stream after %d global batches "
                "of %d (then a source has no unread example left)",
                plan.steps,
                batch,
            )
        skips = SkipCount("Mixture") if self.skip_errors else None
        readers = [RecordReader(splits[name][0], spec, skips=skips) for name in names]
        orders = [
            EpochOrder(len(splits[name][0]), getattr(self.sources[name], "seed", 0))
            for name in names
        ]
        import grain

        options = grain.ReadOptions(
            num_threads=self.read_threads, prefetch_buffer_size=self.prefetch
        )

        def read(step: int, rows: np.ndarray) -> Batch:
            source, position = plan.select(step * batch + rows)
            out = {key: np.empty(field.rows(len(rows)), field.dtype) for key, field in spec.items()}
            for s in np.unique(source):
                chosen = source == s
                part = readers[s].train(orders[s].records(position[chosen]))
                for key in out:
                    out[key][chosen] = part[key]
            return check_batch(out, spec, len(rows), name="Mixture")

        def open_train(partition: Partition) -> MixtureIterator:
            rows = rows_of(partition, batch)
            steps = grain.MapDataset.range(plan.steps).map(lambda step: read(step, rows))
            return MixtureIterator(iter(steps.to_iter_dataset(options)), plan, names)

        passes = [
            one_pass(RecordReader(val, spec, skips=skips), batch=batch, options=options, name=name)
            for name, (_, val) in splits.items()
            if val is not None and len(val)
        ]

        def open_val(partition: Partition) -> Iterator[Batch]:
            return itertools.chain.from_iterable(open_pass(partition) for open_pass in passes)

        return Dataset(
            train=open_train,
            val=open_val if passes else None,
            records=sum(plan.sizes),
            batch=batch,
            spec=spec,
        )


def _common_spec(specs: dict[str, dict[str, Field]]) -> dict[str, Field]:
    """The spec every source shares; else an error naming the source and the field."""
    (first, spec), *rest = specs.items()
    for name, other in rest:
        for key in sorted(set(spec) | set(other)):
            if key not in other or key not in spec:
                has, lacks = (first, name) if key in spec else (name, first)
                raise ValueError(
                    f"Mixture: source {has!r} has the field {key!r} and source {lacks!r} does "
                    f"not (fields {sorted(specs[has])} and {sorted(specs[lacks])}); mix "
                    f"sources that yield the same fields"
                )
            if other[key] != spec[key]:
                raise ValueError(
                    f"Mixture: field {key!r} is {other[key].dtype} {list(other[key].shape)} in "
                    f"source {name!r} but {spec[key].dtype} {list(spec[key].shape)} in source "
                    f"{first!r}; give the sources the same seq_len / sizes"
                )
    return dict(spec)


class _Plan:
    """Which source, and which of its positions, each position of the stream reads."""

    def __init__(self, stages, *, sizes: list[int], batch: int, stop: bool):
        self.stages = [(step, weights) for step, weights in stages]
        self.starts = [step for step, _ in stages]
        self.parts = [proportions(list(weights.values())) for _, weights in stages]
        self.sizes, self.batch = sizes, batch
        # each source's position at the first step of every stage
        self.offsets = [np.zeros(len(sizes), np.int64)]
        for (start, parts), end in zip(
            zip(self.starts, self.parts, strict=True), self.starts[1:], strict=False
        ):
            counts = interleave_counts(np.asarray([(end - start) * batch]), parts)[0]
            self.offsets.append(self.offsets[-1] + counts)
        self.steps = self._last_full_step() if stop else sys.maxsize

    def stage_of(self, step: int) -> int:
        return int(np.searchsorted(self.starts, step, side="right")) - 1

    def positions(self, step: int) -> np.ndarray:
        """Each source's position before global batch ``step``: examples handed out."""
        stage = self.stage_of(step)
        local = (step - self.starts[stage]) * self.batch
        return self.offsets[stage] + interleave_counts(np.asarray([local]), self.parts[stage])[0]

    def select(self, elements: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, position in it)`` of each element (position of the stream)."""
        stage = self.stage_of(int(elements[0]) // self.batch)
        local = elements - self.starts[stage] * self.batch
        before = interleave_counts(local, self.parts[stage])
        after = interleave_counts(local + 1, self.parts[stage])
        source = np.argmax(after - before, axis=1)
        position = self.offsets[stage][source] + before[np.arange(len(local)), source]
        return source, position

    def _last_full_step(self) -> int:
        """The number of global batches before a source would run out."""

        def fits(steps: int) -> bool:
            return bool(np.all(self.positions(steps) <= self.sizes))

        high = 1
        while fits(high):
            high *= 2
        low = 0  # fits(low) holds (nothing read); fits(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low


class MixtureIterator:
    """The training iterator of a :class:`Mixture`: Grain's, with a position that
    records every source's position and epoch, the weights in force and the schedule."""

    def __init__(self, iterator, plan: _Plan, names: list[str]):
        self._iterator, self._plan, self._names = iterator, plan, names

    def __iter__(self) -> MixtureIterator:
        return self

    def __next__(self) -> Batch:
        return next(self._iterator)

    def get_state(self) -> dict:
        step = int(self._iterator.get_state()["next_index"])
        plan = self._plan
        positions = plan.positions(step)
        return {
            "step": step,
            "sources": {
                name: {"position": int(position), "epoch": int(position) // size}
                for name, position, size in zip(self._names, positions, plan.sizes, strict=True)
            },
            "weights": plan.stages[plan.stage_of(step)][1],
            "schedule": [[start, weights] for start, weights in plan.stages],
        }

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or not {"step", "sources"} <= state.keys():
            raise ValueError(
                f"Mixture: the saved data position {state!r:.200} is not a Mixture's (it has "
                f"no step and sources); was the checkpoint written by a run on another reader?"
            )
        step = int(state["step"])
        expected = self._plan.positions(step)
        for name, position in zip(self._names, expected, strict=True):
            saved = state["sources"].get(name, {}).get("position")
            if saved != int(position):
                raise ValueError(
                    f"Mixture: the checkpoint at step {step} has source {name!r} at position "
                    f"{saved}, but the configured weights and schedule put it at "
                    f"{int(position)}; the checkpoint was read with the schedule "
                    f"{state.get('schedule')}. Keep the stages before step {step} as they were "
                    f"(later stages may change)"
                )
        self._iterator.set_state({"next_index": step})
