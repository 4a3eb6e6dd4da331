"""Videos: clips of .npy arrays and GIFs, clip length, stride, hop, resizing, errors."""

import logging

import numpy as np
import pytest
from PIL import Image

from dew.data import Partition, RecordError, Videos

COLORS = np.asarray([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)], np.uint8)


def patterned(frames, height, width):
    """Frame t, pixel (y, x) is COLORS[(x + 2 y + t) % 4]: exact through a GIF palette."""
    t, y, x = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
    return COLORS[(x + 2 * y + t) % 4]


def write_gif(path, video):
    frames = [Image.fromarray(f) for f in video]
    frames[0].save(
        path, save_all=True, append_images=frames[1:], duration=40, loop=0, optimize=False
    )


def test_npy_clips_follow_frames_stride_and_hop(tmp_path):
    video = np.arange(10 * 2 * 3 * 3, dtype=np.uint8).reshape(10, 2, 3, 3)
    np.save(tmp_path / "a.npy", video)
    reader = Videos(tmp_path / "a.npy", frames=3, stride=2, hop=2)
    # The span is 5 frames; starts 0, 2, 4 fit in 10 frames (6 would need frame 10).
    assert reader.clips() == [(str(tmp_path / "a.npy"), s) for s in (0, 2, 4)]
    data = reader.load(batch=3)
    batch = next(data.train(Partition()))
    assert batch["video"].dtype == np.uint8 and batch["video"].shape == (3, 3, 2, 3, 3)
    expected = {video[s : s + 5 : 2].tobytes() for s in (0, 2, 4)}
    assert {clip.tobytes() for clip in batch["video"]} == expected
    assert len(Videos(tmp_path / "a.npy", frames=3, stride=2).clips()) == 2  # hop = span = 5


def test_gif_frames_match_the_frames_written(tmp_path):
    video = patterned(6, 4, 5)
    write_gif(tmp_path / "clip.gif", video)
    np.save(tmp_path / "other.npy", patterned(4, 4, 5)[::-1].copy())
    data = Videos(tmp_path, frames=2, stride=3, val_fraction=0.34).load(batch=1)
    # Clips in file order: clip.gif frames (0, 3); other.npy frames (0, 3) is held out.
    train = next(data.train(Partition()))["video"][0]
    np.testing.assert_array_equal(train, video[[0, 3]])
    val = list(data.val(Partition()))
    np.testing.assert_array_equal(val[0]["video"][0], patterned(4, 4, 5)[::-1][[0, 3]])


def test_size_resizes_and_crops_every_frame(tmp_path):
    flat = np.broadcast_to(np.asarray([7, 70, 140], np.uint8), (3, 10, 20, 3)).copy()
    flat[1] = 0
    np.save(tmp_path / "a.npy", flat)
    np.save(tmp_path / "b.npy", np.zeros((3, 6, 6, 3), np.uint8))
    with pytest.raises(ValueError, match=r"a\.npy is 10x20.*b\.npy is 6x6.*pass size="):
        Videos(tmp_path, frames=3).load(batch=1)
    data = Videos(tmp_path, frames=3, size=4, seed=1).load(batch=2)
    clips = next(data.train(Partition()))["video"]
    assert clips.shape == (2, 3, 4, 4, 3)
    a = next(c for c in clips if c.any())
    assert (a[0] == [7, 70, 140]).all() and (a[1] == 0).all() and (a[2] == [7, 70, 140]).all()


def test_unreadable_clip_names_the_file_or_is_skipped_and_counted(tmp_path, caplog):
    np.save(tmp_path / "good.npy", np.zeros((4, 2, 2, 3), np.uint8))
    (tmp_path / "broken.gif").write_bytes(b"GIF89a not really")
    np.save(tmp_path / "floats.npy", np.zeros((4, 2, 2, 3), np.float32))
    with pytest.raises(RecordError, match=r"broken\.gif.*skip_errors=True"):
        Videos(tmp_path, frames=2).load(batch=1)
    with caplog.at_level(logging.WARNING, logger="dew.data"):
        data = Videos(tmp_path, frames=2, skip_errors=True).load(batch=1)
    assert data.records == 2  # the two clips of good.npy
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "broken.gif" in messages and "floats.npy" in messages and "uint8" in messages
    assert "2 skipped so far" in messages


def test_too_short_and_missing_files(tmp_path):
    np.save(tmp_path / "short.npy", np.zeros((3, 2, 2, 3), np.uint8))
    with pytest.raises(ValueError, match=r"4 frames 2 apart \(7 frames\); the longest has 3"):
        Videos(tmp_path, frames=4, stride=2).load(batch=1)
    with pytest.raises(FileNotFoundError, match="missing"):
        Videos(tmp_path / "missing").load(batch=1)


def test_validation_clips_from_the_head_or_separate_files(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    video = np.arange(8 * 2 * 2 * 3, dtype=np.uint8).reshape(8, 2, 2, 3)
    np.save(tmp_path / "train" / "a.npy", video)  # clips start at frames 0, 2, 4, 6
    clips = np.stack([video[s : s + 2] for s in (0, 2, 4, 6)])
    head = Videos(tmp_path / "train", frames=2, val_fraction=0.5, val_from="head").load(batch=2)
    val = np.concatenate([b["video"] for b in head.val(Partition())])
    np.testing.assert_array_equal(val, clips[:2])
    train = next(head.train(Partition()))["video"]
    assert sorted(c.tobytes() for c in train) == sorted(c.tobytes() for c in clips[2:])
    np.save(tmp_path / "val" / "b.npy", video[::-1].copy())
    separate = Videos(tmp_path / "train", frames=2, val_paths=tmp_path / "val").load(batch=4)
    assert separate.records == 4
    val = np.concatenate([b["video"] for b in separate.val(Partition())])
    np.testing.assert_array_equal(val, np.stack([video[::-1][s : s + 2] for s in (0, 2, 4, 6)]))
    np.save(tmp_path / "val" / "b.npy", np.zeros((4, 3, 3, 3), np.uint8))
    with pytest.raises(ValueError, match=r"validation examples \(video uint8 \[2, 3, 3, 3\]\)"):
        Videos(tmp_path / "train", frames=2, val_paths=tmp_path / "val").load(batch=2)
