"""SFTExamples and ChatTemplate: masks against hand-written renderings, packing,
resumed positions, the sources, and bad rows named."""

import json
import re

import numpy as np
import pytest

from dew.data import (
    ChatTemplate,
    ChatTemplateError,
    HFTokenizer,
    Partition,
    RecordError,
    SFTExamples,
)
from dew.data.sft import check_roles, pack_best_fit
from dew.data.testing import CHATML, CHATML_GENERATION, write_chat_tokenizer

CHATS = [
    [
        {"role": "system", "content": "answer briefly."},
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "four."},
        {"role": "user", "content": "and one plus one?"},
        {"role": "assistant", "content": "two."},
    ],
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello"}],
    [{"role": "user", "content": "how are you?"}, {"role": "assistant", "content": "fine."}],
]


def chatml(messages):
    """ChatML written by hand: the rendering the template must give."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return HFTokenizer(write_chat_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def chats(tmp_path, write_jsonl):
    return write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])


def masked_text(tokenizer, batch, row):
    """The trained text of each example of a batch row."""
    ids, mask, segments = (batch[k][row] for k in ("text", "loss_mask", "segment_ids"))
    return [
        tokenizer.decode(ids[(segments == s) & mask], skip_special_tokens=False)
        for s in range(1, segments.max() + 1)
    ]


def test_chat_rows_train_on_the_assistant_turns_only(tokenizer, chats):
    data = SFTExamples(chats, seq_len=79, tokenizer=tokenizer, read_threads=0)
    tokens = data.tokenize(data.source)
    for example, messages in enumerate(CHATS):
        ids = tokens.ids[tokens.starts[example] : tokens.starts[example + 1]]
        mask = tokens.mask[tokens.starts[example] : tokens.starts[example + 1]]
        # the whole rendering tokenized at once, no specials added (transformers' way)
        assert ids.tolist() == tokenizer.encode_with_offsets(chatml(messages))[0]
        trained = tokenizer.decode(ids[mask], skip_special_tokens=False)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert trained == "".join(f"{a}<|im_end|>\n" for a in answers)
    assert ChatTemplate.of_tokenizer(tokenizer).render(CHATS[1]) == chatml(CHATS[1])


def test_generation_blocks_mark_the_assistant_text(tmp_path, chats):
    tokenizer = HFTokenizer(write_chat_tokenizer(tmp_path / "gen", template=CHATML_GENERATION))
    template = ChatTemplate.of_tokenizer(tokenizer)
    assert template.has_generation and not ChatTemplate(CHATML).has_generation
    text, spans = template.assistant_spans(CHATS[0])
    assert text == chatml(CHATS[0])
    assert [text[a:b] for a, b in spans] == ["four.<|im_end|>", "two.<|im_end|>"]
    data = SFTExamples(chats, seq_len=79, tokenizer=tokenizer, read_threads=0).load(batch=3)
    batch = next(data.train(Partition()))
    assert sorted(sum((masked_text(tokenizer, batch, r) for r in range(3)), [])) == sorted(
        ["four.<|im_end|>two.<|im_end|>", "hello<|im_end|>", "fine.<|im_end|>"]
    )


def test_prompt_completion_rows(tokenizer, tmp_path, write_jsonl):
    rows = [
        {"prompt": "what is two plus two?", "completion": " four."},
        {"prompt": CHATS[1][:1], "completion": CHATS[1][1:]},  # conversational
    ]
    data = SFTExamples(write_jsonl(tmp_path / "pc.jsonl", rows), seq_len=31, tokenizer=tokenizer)
    tokens = data.tokenize(data.source)
    first = tokens.ids[: tokens.starts[1]].tolist()
    prompt, completion = tokenizer.encode(rows[0]["prompt"]), tokenizer.encode(" four.")
    assert first == prompt + completion + [tokenizer.end_id]
    assert tokens.mask[: tokens.starts[1]].tolist() == [False] * len(prompt) + [True] * (
        len(completion) + 1
    )
    second = tokens.ids[tokens.starts[1] :][tokens.mask[tokens.starts[1] :]]
    assert tokenizer.decode(second, skip_special_tokens=False) == "hello<|im_end|>\n"


def test_packing_keeps_every_example_whole_and_apart(tokenizer, chats):
    unpacked = SFTExamples(chats, seq_len=79, tokenizer=tokenizer, read_threads=0)
    packed = SFTExamples(chats, seq_len=79, tokenizer=tokenizer, packing=True, read_threads=0)
    tokens = unpacked.tokenize(chats)
    lengths = tokens.lengths.tolist()
    assert pack_best_fit(lengths, 80) == pack_best_fit(lengths, 80)  # deterministic
    windows = packed._windows(tokens)
    assert windows.count == 2 < len(lengths)  # 70 ids alone; 28 + 26 share a window
    seen = []
    for w in range(windows.count):
        row = windows.example(w)
        for s in range(1, row["segment_ids"].max() + 1):
            here = row["segment_ids"] == s
            assert row["positions"][here].tolist() == list(range(here.sum()))
            seen.append((row["text"][here].tolist(), row["loss_mask"][here].tolist()))
        assert not row["loss_mask"][row["segment_ids"] == 0].any()
    examples = [
        (tokens.ids[a:b].tolist(), tokens.mask[a:b].tolist())
        for a, b in zip(tokens.starts, tokens.starts[1:], strict=False)
    ]
    assert sorted(seen) == sorted(examples)
    # best-fit decreasing by hand: bins of 10 for 6, 5, 4, 3, 2 -> [6, 4], [5, 3, 2]
    assert pack_best_fit([2, 6, 4, 5, 3], 10) == [[1, 2], [3, 4, 0]]


def test_resumed_position_matches(tokenizer, chats):
    data = SFTExamples(chats, seq_len=79, tokenizer=tokenizer).load(batch=2)
    iterator = data.train(Partition())
    for _ in range(3):
        next(iterator)
    state = iterator.get_state()
    want = [next(iterator) for _ in range(3)]
    fresh = data.train(Partition())
    fresh.set_state(state)
    for expected in want:
        got = next(fresh)
        assert all(np.array_equal(got[k], expected[k]) for k in expected)


def test_parquet_and_datasets_sources_read_alike(tokenizer, chats, tmp_path):
    import datasets

    table = datasets.Dataset.from_list([{"messages": m} for m in CHATS])
    table.to_parquet(tmp_path / "chats.parquet")
    reference = SFTExamples(chats, seq_len=79, tokenizer=tokenizer).tokenize(chats)
    for source in (table, tmp_path / "chats.parquet"):
        tokens = SFTExamples(source, seq_len=79, tokenizer=tokenizer).tokenize(source)
        assert np.array_equal(tokens.ids, reference.ids)
        assert np.array_equal(tokens.mask, reference.mask)


def test_roles_are_checked():
    assert check_roles(CHATS[0]) is None
    assert "do not alternate: message 1 is 'user' after 'user'" in check_roles(
        [CHATS[1][0], CHATS[1][0], CHATS[1][1]]
    )
    assert "no assistant turn" in check_roles(CHATS[1][:1])


BAD = {
    "roles": ({"messages": [CHATS[1][1], CHATS[1][0]]}, r"roles do not alternate"),
    "no assistant": ({"messages": CHATS[1][:1]}, r"no assistant turn"),
    "template": (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "!"}]},
        r"chat template failed to render \(TemplateError: no shouting\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_rows_are_named(case, tmp_path, write_jsonl, tokenizer):
    row, message = BAD[case]
    template = CHATML.replace(
        "{% for message in messages %}",
        "{% for message in messages %}{% if message['content'] == '!' %}"
        "{{ raise_exception('no shouting') }}{% endif %}",
    )
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHATS[2]}, row])
    reader = SFTExamples(path, seq_len=79, tokenizer=tokenizer, chat_template=template)
    with pytest.raises(RecordError, match=rf"row 1 of .*bad.jsonl.*{message}"):
        reader.tokenize(path)
    skipping = SFTExamples(
        path, seq_len=79, tokenizer=tokenizer, chat_template=template, skip_errors=True
    )
    assert skipping.tokenize(path).rows.tolist() == [0]


@pytest.mark.parametrize(
    "rows, says",
    [
        (  # prompt/completion rows, the third without its completion
            [{"prompt": "a", "completion": "b"}] * 2 + [{"prompt": "c"}],
            r"rows.jsonl, line 3: no field 'completion'; the fields there are \['prompt'\]; "
            r"the rows before it have 'prompt' and 'completion'",
        ),
        (  # conversations, the third a prompt/completion row
            [{"messages": CHATS[1]}] * 2 + [{"prompt": "c", "completion": "d"}],
            r"line 3: no field 'messages'; the fields there are \['completion', 'prompt'\]; "
            r"the rows before it have 'messages'",
        ),
        (  # the first row is neither kind
            [{"text": "a"}, {"prompt": "a", "completion": "b"}],
            r"rows need a 'messages' column .* or 'prompt' and 'completion' columns; "
            r".*line 1: no field 'messages'",
        ),
    ],
    ids=["completion", "messages", "neither"],
)
def test_a_row_missing_a_field_is_named_by_its_line(rows, says, tmp_path, write_jsonl):
    """The row at fault is the first that lacks a field of the kind its predecessors
    are (not line 1 for a file of prompt/completion rows)."""
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(KeyError) as error:
        SFTExamples(path, seq_len=63).tokenize(path)
    message = error.value.args[0]
    assert message.startswith("SFTExamples: "), message
    assert re.search(says, message), message


def test_too_long_and_cut_completions_are_named(tmp_path, write_jsonl, tokenizer):
    path = write_jsonl(
        tmp_path / "pc.jsonl",
        [
            {"prompt": "hi", "completion": "yes"},
            {"prompt": "the lazy dog " * 8, "completion": "no"},
        ],
    )
    with pytest.raises(
        RecordError,
        match=r"row 1 of .* longer than a packed window of seq_len "
        r"\+ 1 = 16; set max_length=16",
    ):
        SFTExamples(path, seq_len=15, tokenizer=tokenizer, packing=True).tokenize(path)
    with pytest.raises(
        RecordError,
        match=r"row 1 of .* completion is empty after cutting to "
        r"max_length=16",
    ):
        SFTExamples(path, seq_len=15, tokenizer=tokenizer, max_length=16).tokenize(path)


def test_templates_run_sandboxed(tmp_path, write_jsonl, tokenizer):
    """A template from a downloaded file cannot reach Python: the sandbox refuses."""
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}" + CHATML
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[1]}])
    with pytest.raises(RecordError, match=r"row 0 of .*SecurityError"):
        SFTExamples(path, seq_len=79, tokenizer=tokenizer, chat_template=escape).tokenize(path)
    assert json.loads(open(tmp_path / "c.jsonl").read())["messages"] == CHATS[1]


def test_the_template_is_found_or_refused(tmp_path, chats):
    folder = write_chat_tokenizer(tmp_path / "tok", template=CHATML)
    config_file = tmp_path / "tok" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [{"name": "default", "template": CHATML_GENERATION}]
    config_file.write_text(json.dumps(config))
    assert ChatTemplate.of_tokenizer(HFTokenizer(folder)).has_generation  # a named list
    (tmp_path / "tok" / "chat_template.jinja").write_text(CHATML)  # the file comes first
    assert not ChatTemplate.of_tokenizer(HFTokenizer(folder)).has_generation
    with pytest.raises(ChatTemplateError, match="does not compile"):
        SFTExamples(chats, tokenizer=HFTokenizer(folder), chat_template="{% for %}").tokenize(chats)
    del config["chat_template"]
    (tmp_path / "tok" / "chat_template.jinja").unlink()
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no chat template .* chat_template="):
        SFTExamples(chats, tokenizer=HFTokenizer(folder)).tokenize(chats)
