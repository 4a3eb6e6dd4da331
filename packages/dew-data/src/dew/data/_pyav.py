"""MP4 and WebM clips decoded with PyAV (``av``, the ``[video]`` extra) for ``Videos``.

Frames are numbered in presentation order from 0. A clip that starts late in
a file seeks to the key frame before it (``container.seek``) and numbers the
decoded frames from their timestamps, ``round((pts - start) * time_base *
frame_rate)``, as torchvision's and decord's readers do; a stream without
timestamps or a frame rate is decoded from its first frame instead.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from dew.data._extra import hf_import

SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi")


def _av(path: str):
    return hf_import("av", needed_by=f"Videos reading {path}", extra="video")


def _open(path: str):
    av = _av(path)
    try:
        container = av.open(path)
    except av.FFmpegError as error:
        raise ValueError(f"PyAV cannot open it: {error}") from error
    if not container.streams.video:
        container.close()
        raise ValueError("the file has no video stream")
    return av, container


def header(path: str) -> tuple[int, int, int]:
    """``(frames, height, width)`` of the first video stream of ``path``.

    The frame count is the container's (MP4 states it) or, where it states
    none (WebM), the count of the stream's packets, read without decoding.
    """
    av, container = _open(path)
    with container:
        stream = container.streams.video[0]
        height, width = stream.codec_context.height, stream.codec_context.width
        count = stream.frames
        if count <= 0:
            try:
                count = sum(1 for packet in container.demux(stream) if packet.size)
            except av.FFmpegError as error:
                raise ValueError(f"PyAV cannot read its packets: {error}") from error
    if height < 1 or width < 1:
        raise ValueError(f"the video stream has no frame size ({height}x{width})")
    return count, height, width


def _frame_index(frame, start: int, time_base: Fraction, rate: Fraction) -> int:
    return round((frame.pts - start) * time_base * rate)


def frames(path: str, frame_indices: range) -> np.ndarray:
    """Frames ``frame_indices`` (increasing) of ``path``: uint8 ``[frames, height, width, 3]``
    (RGB, converted from the stream's pixel format by libswscale)."""
    av, container = _open(path)
    wanted = set(frame_indices)
    last = frame_indices[-1]
    found: dict[int, np.ndarray] = {}
    with container:
        stream = container.streams.video[0]
        rate, time_base = stream.average_rate, stream.time_base
        start = stream.start_time or 0
        timed = bool(rate) and time_base is not None and stream.start_time is not None
        try:
            if timed and frame_indices.start > 0:
                target = start + int(frame_indices.start / (rate * time_base))
                container.seek(target, stream=stream, backward=True, any_frame=False)
            for order, frame in enumerate(container.decode(stream)):
                if timed and frame.pts is not None:
                    index = _frame_index(frame, start, time_base, rate)
                elif timed:
                    raise ValueError("a frame has no timestamp")
                else:
                    index = order
                if index in wanted:
                    found[index] = frame.to_ndarray(format="rgb24")
                if index >= last:
                    break
        except av.FFmpegError as error:
            raise ValueError(f"PyAV cannot decode it: {error}") from error
    missing = sorted(wanted - found.keys())
    if missing:
        raise ValueError(
            f"frames {missing[:4]}{'...' if len(missing) > 4 else ''} of the clip were not "
            f"decoded (the file holds fewer frames than its header says, or its timestamps "
            f"skip them)"
        )
    return np.stack([found[index] for index in frame_indices])
