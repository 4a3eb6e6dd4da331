"""Damaged checkpoint files are named, and a Hugging Face checkpoint without a
tokenizer takes its end and pad ids from config.json / generation_config.json.

Every checkpoint here is written by the test (a tiny Llama, no tokenizer) and
then edited or cut: a malformed or empty JSON file, a truncated safetensors
file, a config with a zero count, token ids of every form transformers writes.
"""

import json

import jax
import pytest

from dew.data import ByteTokenizer
from dew.sampling import Pretrained, Sampling, TextGeneration, generate

GREEDY = Sampling(temperature=0)
NEW = 8  # new tokens: the program test_generate compiles too


@pytest.fixture
def hf_dir(tiny, tmp_path):
    """A Llama checkpoint without tokenizer.json and without token ids in config.json."""
    model, params = tiny("llama")
    path = Pretrained(model=model, params=params, format="llama").save(tmp_path / "llama")
    assert not (path / "tokenizer.json").exists()
    return path


@pytest.fixture
def dew_dir(tiny, tmp_path):
    model, params = tiny("llama")
    return Pretrained(model=model, params=params, format="dew").save(tmp_path / "dew")


def edit_json(path, **changes):
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# ------------------------------------------------------------------ JSON files


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"model_type": "llama", "hidden_size": 32,', r"is not valid JSON: .* at line 1"),
        ("", r"is not valid JSON: .*The file is empty"),
        ("[1, 2]", r"holds a JSON list, not an object"),
    ],
)
@pytest.mark.parametrize("which", ["hf", "dew"])
def test_a_malformed_config_file_is_named_with_what_to_do(hf_dir, dew_dir, which, text, message):
    directory, name = (hf_dir, "config.json") if which == "hf" else (dew_dir, "dew_config.json")
    (directory / name).write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        Pretrained.load(directory)
    assert str(directory / name) in str(error.value)
    assert "download or save the checkpoint again" in str(error.value)


def test_a_malformed_generation_config_is_named(hf_dir):
    (hf_dir / "generation_config.json").write_text('{"eos_token_id": [2, 5')
    with pytest.raises(ValueError, match=r"generation_config.json \(the generation defaults\)"):
        Pretrained.load(hf_dir)


def test_a_malformed_shard_index_is_named(tiny, tmp_path):
    model, params = tiny("llama")
    path = Pretrained(model=model, params=params, format="llama").save(
        tmp_path / "sharded", max_shard_bytes=20_000
    )
    index = path / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    with pytest.raises(ValueError, match=r"index of the weight shards\) is not valid JSON") as e:
        Pretrained.load(path)
    assert str(index) in str(e.value)


# ------------------------------------------------------------------ safetensors


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.0])
@pytest.mark.parametrize("which", ["hf", "dew"])
def test_a_truncated_weights_file_is_named_with_its_size(hf_dir, dew_dir, which, keep):
    directory = hf_dir if which == "hf" else dew_dir
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError) as error:
        Pretrained.load(directory)
    message = str(error.value)
    assert message.startswith(f"{weights} is not a readable safetensors file")
    assert f"the file is {int(len(data) * keep)} bytes" in message
    assert "cut off while being saved or downloaded. Download or save the checkpoint again" in (
        message
    )


# ------------------------------------------------------------------ counts in a config


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_attention_heads", 0),
        ("hidden_size", -8),
        ("vocab_size", 0),
        ("num_hidden_layers", 2.5),
    ],
)
def test_a_zero_count_in_config_json_names_the_file_and_field(hf_dir, field, value):
    edit_json(hf_dir / "config.json", **{field: value})
    with pytest.raises(ValueError) as error:
        Pretrained.load(hf_dir)
    assert str(error.value).startswith(
        f"{hf_dir}: config.json sets {field}={value!r}, but a llama checkpoint needs a whole "
        f"number >= 1 there"
    )


def test_a_zero_count_in_dew_config_names_the_file_and_field(dew_dir):
    description = json.loads((dew_dir / "dew_config.json").read_text())
    description["model"]["config"]["num_heads"] = 0
    (dew_dir / "dew_config.json").write_text(json.dumps(description))
    with pytest.raises(ValueError) as error:
        Pretrained.load(dew_dir)
    assert str(error.value).startswith(
        f"{dew_dir / 'dew_config.json'} describes a model Dew cannot build: CausalTransformer got "
        f"an invalid count: num_heads=0 (attention heads) must be a whole number >= 1"
    )


# ------------------------------------------------------------------ ids without a tokenizer


@pytest.mark.parametrize(
    "config, generation, end_ids, pad_id",
    [
        ({}, None, (), None),  # nothing known: generate's own defaults apply
        ({"eos_token_id": 7, "pad_token_id": None}, None, (7,), 7),  # pad = eos (transformers)
        ({"eos_token_id": [7, 9], "pad_token_id": 3}, None, (7, 9), 3),
        (  # generation_config.json first, then config.json, without repeats
            {"eos_token_id": 7, "pad_token_id": None},
            {"eos_token_id": [9, 7], "pad_token_id": 0},
            (9, 7),
            0,
        ),
        ({"eos_token_id": None}, {"eos_token_id": 11}, (11,), 11),
    ],
)
def test_end_and_pad_ids_come_from_the_configs(hf_dir, config, generation, end_ids, pad_id):
    edit_json(hf_dir / "config.json", **config)
    if generation is not None:
        (hf_dir / "generation_config.json").write_text(json.dumps(generation))
    loaded = Pretrained.load(hf_dir)
    assert loaded.tokenizer is None
    assert loaded.end_ids == end_ids and loaded.pad_id == pad_id
    if generation is not None:  # written back with the checkpoint
        again = Pretrained.load(loaded.save(hf_dir.parent / "again"))
        assert again.generation_config == generation
        assert again.end_ids == end_ids and again.pad_id == pad_id


def test_a_bad_token_id_in_a_config_is_named(hf_dir):
    edit_json(hf_dir / "config.json", eos_token_id="</s>")
    with pytest.raises(ValueError, match=r"config.json: eos_token_id='</s>' must be a token id"):
        Pretrained.load(hf_dir)


def test_the_config_end_id_stops_generation_without_a_tokenizer(hf_dir):
    """The end id read from config.json ends a row where that token is produced."""
    loaded = Pretrained.load(hf_dir)
    free = generate(
        loaded.model, loaded.params, [[5, 9, 2]], NEW, jax.random.key(0), sampling=GREEDY
    )
    new = free.tokens[0][3:]
    end = new[2]
    edit_json(hf_dir / "config.json", eos_token_id=end)
    loaded = Pretrained.load(hf_dir)
    assert loaded.end_ids == (end,)
    out = generate(
        loaded.model,
        loaded.params,
        [[5, 9, 2]],
        NEW,
        jax.random.key(0),
        sampling=GREEDY,
        end_ids=loaded.end_ids,
        pad_id=loaded.pad_id,
    )
    stop = new.index(end) + 1
    assert out.tokens[0] == [5, 9, 2, *new[:stop]] and out.lengths == [stop]


def test_a_pipeline_without_a_tokenizer_names_the_argument_and_the_ids(hf_dir):
    edit_json(hf_dir / "config.json", eos_token_id=7, pad_token_id=3)
    loaded = Pretrained.load(hf_dir)
    with pytest.raises(ValueError) as error:
        loaded.pipeline()
    message = str(error.value)
    assert "this llama checkpoint has no tokenizer (no tokenizer.json" in message
    assert "pipeline(tokenizer=dew.data.HFTokenizer(" in message
    assert "end_ids=(7,), pad_id=3" in message
    task = loaded.pipeline(tokenizer=ByteTokenizer())
    assert isinstance(task, TextGeneration) and task.end_ids == (7,)
    assert isinstance(task.tokenizer, ByteTokenizer)


def test_a_training_checkpoints_directory_is_told_apart(tmp_path):
    (tmp_path / "run" / "100").mkdir(parents=True)
    (tmp_path / "run" / "200").mkdir()
    with pytest.raises(FileNotFoundError) as error:
        Pretrained.load(tmp_path / "run")
    message = str(error.value)
    assert "has neither dew_config.json (a Dew checkpoint) nor config.json" in message
    assert "step directories ['100', '200']" in message
    assert f"dew.train.load_model({str(tmp_path / 'run')!r})" in message
