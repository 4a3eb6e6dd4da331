"""HFImages: image folders and parquet through `datasets`, resize and crop, labels, captions."""

import io
import logging

import numpy as np
import pytest
from PIL import Image

from dew.data import HFImages, Partition, RecordError
from dew.data.images import fit_image

rng = np.random.default_rng(0)


def pixels(height, width):
    return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)


def png_bytes(array):
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def test_fit_image_crops_the_centre_and_resizes_the_shorter_side():
    wide = pixels(8, 12)
    np.testing.assert_array_equal(fit_image(Image.fromarray(wide), 8), wide[:, 2:10])
    tall = pixels(13, 6)
    np.testing.assert_array_equal(fit_image(Image.fromarray(tall), 6), tall[3:9])
    # A constant image stays constant through resampling; the shorter side becomes 4.
    flat = np.full((20, 30, 3), (10, 200, 30), np.uint8)
    out = fit_image(Image.fromarray(flat), 4)
    assert out.shape == (4, 4, 3) and (out == (10, 200, 30)).all()
    # Grayscale and palette images come out as RGB.
    gray = Image.fromarray(np.arange(16, dtype=np.uint8).reshape(4, 4), mode="L")
    np.testing.assert_array_equal(fit_image(gray, 4)[..., 1], np.arange(16).reshape(4, 4))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An image folder: two classes, three images each, of different sizes."""
    root = tmp_path_factory.mktemp("folder")
    images = {}
    for label, name in enumerate(["cat", "dog"]):
        (root / name).mkdir()
        for i in range(3):
            array = pixels(8, 8 + 2 * i)
            Image.fromarray(array).save(root / name / f"{i}.png")
            images[(label, i)] = array
    return root, images


def test_image_folder_gives_cropped_uint8_images_and_labels(folder, tmp_path):
    root, images = folder
    data = HFImages(root, image_size=8, cache_dir=tmp_path, seed=2).load(batch=3)
    assert data.records == 6
    iterator = data.train(Partition())
    batches = [next(iterator) for _ in range(2)]
    got = {(int(b["label"][r]), b["image"][r].tobytes()) for b in batches for r in range(3)}
    expected = {(label, array[:, i : i + 8].tobytes()) for (label, i), array in images.items()}
    assert got == expected  # one epoch: every image once, centre-cropped, with its label
    assert batches[0]["image"].dtype == np.uint8 and batches[0]["image"].shape == (3, 8, 8, 3)
    assert batches[0]["label"].dtype == np.int32
    assert "text" not in batches[0]


def test_parquet_with_captions_and_a_validation_fraction(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = [pixels(6, 6) for _ in range(5)]
    captions = ["a red fox", "", "sky", "x" * 20, "dew"]
    table = pa.table(
        {
            "img": [{"bytes": png_bytes(a), "path": f"{i}.png"} for i, a in enumerate(arrays)],
            "caption": captions,
        }
    )
    pq.write_table(table, tmp_path / "images.parquet")
    data = HFImages(
        tmp_path / "images.parquet",
        image_size=6,
        text_len=8,
        val_fraction=0.2,
        cache_dir=tmp_path / "hf",
    ).load(batch=2)
    assert data.records == 4
    val = next(iter(data.val(Partition())))
    # The last row is held out; the second validation row is padding.
    np.testing.assert_array_equal(val["image"][0], arrays[4])
    assert val["example_mask"].tolist() == [True, False]
    assert val["text"][0].tolist() == [100, 101, 119] + [257] * 5  # "dew" then pad ids
    assert val["text_mask"][0].tolist() == [True] * 3 + [False] * 5
    rows = [next(data.train(Partition())) for _ in range(1)][0]
    for image, text, mask in zip(rows["image"], rows["text"], rows["text_mask"]):
        i = next(i for i, a in enumerate(arrays) if (a == image).all())
        assert bytes(text[mask].tolist()).decode() == captions[i][:8]


def test_unreadable_image_names_the_record_or_is_skipped_and_counted(tmp_path, caplog):
    import datasets

    good = png_bytes(pixels(4, 4))
    dataset = datasets.Dataset.from_dict(
        {
            "image": [
                {"bytes": good, "path": "good.png"},
                {"bytes": b"not an image", "path": "broken.png"},
            ]
        },
        features=datasets.Features({"image": datasets.Image()}),
    )
    data = HFImages(dataset, image_size=4, read_threads=0).load(batch=2)
    with pytest.raises(RecordError, match=r"row 1 of .*broken\.png"):
        next(data.train(Partition()))
    skipping = HFImages(dataset, image_size=4, read_threads=0, skip_errors=True).load(batch=2)
    with caplog.at_level(logging.WARNING, logger="dew.data"):
        batch = next(skipping.train(Partition()))
    # The broken row is replaced by the next readable one (row 0, wrapping around).
    assert (batch["image"][0] == batch["image"][1]).all()
    assert any(
        "broken.png" in r.getMessage() and "1 skipped so far" in r.getMessage()
        for r in caplog.records
    )


def test_unknown_columns_and_splits_list_what_exists(folder, tmp_path):
    import datasets

    root, _ = folder
    dataset = datasets.Dataset.from_dict({"pixels": [png_bytes(pixels(4, 4))], "y": [0]})
    with pytest.raises(KeyError, match=r"no image column.*\['pixels', 'y'\]"):
        HFImages(dataset, image_size=4).load(batch=1)
    with pytest.raises(KeyError, match=r"no label column 'class'.*\['pixels', 'y'\]"):
        HFImages(dataset, image_field="pixels", label_field="class").load(batch=1)
    with pytest.raises(KeyError, match=r"no split 'test'.*\['train'\]"):
        HFImages(root, val_split="test", cache_dir=tmp_path).load(batch=1)
    with pytest.raises(FileNotFoundError, match="no_such_folder"):
        HFImages(tmp_path / "no_such_folder").load(batch=1)
