"""Chat templates against Hugging Face transformers: ``dew.data.ChatTemplate`` renders
a tokenizer_config.json's template to the same text as ``apply_chat_template``
(whitespace from trim_blocks / lstrip_blocks, bos_token, tojson keeping HTML
characters, the generation prompt), and ``SFTExamples`` gives the same ids and the
same assistant mask as ``return_assistant_tokens_mask``. Needs transformers only
(no torch); run by the ``parity`` nox session."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from dew.data import ChatTemplate, HFTokenizer, SFTExamples  # noqa: E402
from dew.data.testing import write_chat_tokenizer  # noqa: E402

# block tags on lines of their own, indented: trim_blocks and lstrip_blocks decide
# the whitespace, as in most released templates
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
  {% if message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}

  {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | tojson }}<|im_end|>

  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

MESSAGES = [
    {"role": "system", "content": "answer <b>briefly</b> & kindly."},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "four."},
    {"role": "user", "content": "and one plus one?"},
    {"role": "assistant", "content": "two, i am fine."},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = write_chat_tokenizer(tmp_path_factory.mktemp("tok"), template=TEMPLATE)
    path = f"{folder}/tokenizer_config.json"
    config = json.load(open(path))
    config["bos_token"] = "<|endoftext|>"
    json.dump(config, open(path, "w"))
    return folder


def test_rendering_matches_transformers(folder):
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ours = ChatTemplate.of_tokenizer(HFTokenizer(folder))
    for prompt in (False, True):
        want = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        assert ours.render(MESSAGES, add_generation_prompt=prompt) == want
    assert "<b>briefly</b> &" in want  # tojson kept the HTML characters


def test_ids_and_assistant_mask_match_transformers(folder, tmp_path):
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    out = theirs.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    tokens = SFTExamples(path, seq_len=255, tokenizer=HFTokenizer(folder)).tokenize(path)
    assert tokens.ids.tolist() == list(out["input_ids"])
    assert np.array_equal(tokens.mask, np.asarray(out["assistant_masks"], bool))
    assert tokens.mask.sum() > 0


def test_prefix_rendering_finds_what_generation_blocks_mark(tmp_path):
    """Without {% generation %}, rendering prefix by prefix finds each assistant turn as
    the text after the generation prompt up to the next turn: transformers' mask for a
    template whose blocks mark exactly that, on the same rendering."""
    from dew.data.testing import CHATML

    turn = (
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    )
    marked = CHATML.replace(
        turn,
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
        "{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}{% else %}"
        + turn
        + "{% endif %}",
    )
    assert marked != CHATML
    theirs = transformers.AutoTokenizer.from_pretrained(
        write_chat_tokenizer(tmp_path / "marked", template=marked)
    )
    out = theirs.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    plain = HFTokenizer(write_chat_tokenizer(tmp_path / "plain", template=CHATML))
    tokens = SFTExamples(path, seq_len=255, tokenizer=plain).tokenize(path)
    assert tokens.ids.tolist() == list(out["input_ids"])
    assert np.array_equal(tokens.mask, np.asarray(out["assistant_masks"], bool))
