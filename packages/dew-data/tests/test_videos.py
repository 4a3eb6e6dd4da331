"""Videos: clips of .npy arrays and GIFs, clip length, stride, hop, resizing, errors."""

import logging
import sys

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


# MP4 and WebM through PyAV. The background is a linear ramp (bicubic resizing keeps a
# linear function linear away from the borders, so resized frames have a closed form)
# and a yellow square moves one pixel right per frame.
HEIGHT, WIDTH = 16, 24


def ramp_with_square(frames, *, square=True):
    t, y, x = np.meshgrid(np.arange(frames), np.arange(HEIGHT), np.arange(WIDTH), indexing="ij")
    video = np.stack([4 * x + 3 * y + 10, 2 * x + 5 * y + 20, 3 * x + 2 * y + 30], -1)
    video = video.astype(np.uint8)
    for f in range(frames if square else 0):
        video[f, 4:8, 2 + f : 6 + f] = (250, 250, 40)
    return video


def write_clip(path, video, *, codec, pixel_format, options):
    """Encode ``video`` with PyAV, a key frame every 4 frames (so late clips seek)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=10, options={"g": "4", **options})
        stream.height, stream.width, stream.pix_fmt = HEIGHT, WIDTH, pixel_format
        for frame in video:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


# (suffix, codec, pixel format, options, atol): H.264 at crf 0 in yuv444p loses only the
# 8-bit RGB <-> YUV rounding (measured max 2 levels); lossless VP9 in planar RGB is exact.
CODECS = {
    "mp4": (".mp4", "libx264", "yuv444p", {"crf": "0"}, 2),
    "webm": (".webm", "libvpx-vp9", "gbrp", {"lossless": "1"}, 0),
}


@pytest.mark.parametrize("kind", sorted(CODECS))
def test_mp4_and_webm_clips_match_the_frames_written(tmp_path, kind):
    suffix, codec, pixel_format, options, atol = CODECS[kind]
    video = ramp_with_square(14)
    path = tmp_path / f"clip{suffix}"
    write_clip(path, video, codec=codec, pixel_format=pixel_format, options=options)
    reader = Videos(path, frames=3, stride=2, hop=3)
    # span 5: starts 0, 3, 6, 9 fit in 14 frames; 6 and 9 start past a key frame (seek).
    assert reader.clips() == [(str(path), s) for s in (0, 3, 6, 9)]
    data = reader.load(batch=4)
    clips = next(data.train(Partition()))["video"]
    assert clips.dtype == np.uint8 and clips.shape == (4, 3, HEIGHT, WIDTH, 3)
    clips = sorted(clips, key=lambda clip: int(np.argmax(clip[0, 5, :, 0] > 240)))  # by square
    for clip, start in zip(clips, (0, 3, 6, 9), strict=True):
        expected = video[start : start + 5 : 2].astype(int)
        assert np.abs(clip.astype(int) - expected).max() <= atol, start


def test_decoded_clips_resize_and_crop_like_numpy(tmp_path):
    suffix, codec, pixel_format, options, _ = CODECS["webm"]
    video = ramp_with_square(6, square=False)
    write_clip(
        tmp_path / f"a{suffix}", video, codec=codec, pixel_format=pixel_format, options=options
    )
    clip = next(Videos(tmp_path, frames=2, size=8).load(batch=1).train(Partition()))["video"][0]
    # Shorter side 16 -> 8 (scale 1/2, 24 -> 12 wide), then columns 2..9 of 12 kept. Output
    # pixel (i, j) is centred on input (2 i + 0.5, 2 (j + 2) + 0.5), where the ramp is linear;
    # compare rows and columns whose bicubic support (4 input pixels each side) is inside.
    i, j = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
    y, x = 2 * i + 0.5, 2 * (j + 2) + 0.5
    expected = np.stack([4 * x + 3 * y + 10, 2 * x + 5 * y + 20, 3 * x + 2 * y + 30], -1)
    inner = (slice(2, 6), slice(0, 8))
    assert clip.shape == (2, 8, 8, 3)
    # 1 level: pillow's fixed-point filter weights and the rounding to uint8.
    np.testing.assert_allclose(clip[0][inner], expected[inner], atol=1)
    np.testing.assert_array_equal(clip[0], clip[1])


def test_decoded_clip_position_restores(tmp_path):
    suffix, codec, pixel_format, options, _ = CODECS["mp4"]
    for name, shift in (("a", 0), ("b", 3)):
        video = np.roll(ramp_with_square(12), shift, axis=2)
        write_clip(
            tmp_path / f"{name}{suffix}",
            video,
            codec=codec,
            pixel_format=pixel_format,
            options=options,
        )
    data = Videos(tmp_path, frames=2, stride=2, seed=3).load(batch=2)
    iterator = data.train(Partition())
    next(iterator)
    state = iterator.get_state()
    expected = [next(iterator)["video"] for _ in range(3)]  # crosses an epoch (6 clips)
    fresh = data.train(Partition())
    fresh.set_state(state)
    for batch in expected:
        np.testing.assert_array_equal(next(fresh)["video"], batch)


def test_unreadable_mp4_names_the_file_and_missing_pyav_names_the_extra(tmp_path, monkeypatch):
    suffix, codec, pixel_format, options, _ = CODECS["mp4"]
    write_clip(
        tmp_path / f"good{suffix}",
        ramp_with_square(4),
        codec=codec,
        pixel_format=pixel_format,
        options=options,
    )
    (tmp_path / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a movie" * 4)
    with pytest.raises(RecordError, match=r"broken\.mp4.*PyAV cannot open it.*skip_errors=True"):
        Videos(tmp_path, frames=2).load(batch=1)
    assert Videos(tmp_path, frames=2, skip_errors=True).load(batch=1).records == 2
    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed
    with pytest.raises(ImportError, match=r'good\.mp4 needs av.*pip install "dew-data\[video\]"'):
        Videos(tmp_path / f"good{suffix}", frames=2).load(batch=1)
