"""examples/distill_pretrained.py's student, reloaded by transformers.

The example (a few steps) distils a Llama-format teacher directory into a smaller
student and saves it in the teacher's format; transformers' ``AutoModelForCausalLM``
reads that directory and gives Dew's logits within 1e-4 (float32, CPU), on a batch of
byte-tokenized text. Run by the ``parity`` nox session (torch + transformers).
"""

import pathlib
import runpy
import sys

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dew.sampling import Pretrained  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[4] / "examples" / "distill_pretrained.py"


def test_the_distilled_student_reloads_in_transformers_with_dews_logits(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # the example writes under runs/
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "2"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert "wrote the student to " in capsys.readouterr().out
    teacher = Pretrained.load(tmp_path / "runs" / "distill_pretrained" / "teacher")
    student_dir = tmp_path / "runs" / "distill_pretrained" / "student"
    student = Pretrained.load(student_dir)
    assert student.format == teacher.format == "llama"
    assert student.model.emb_features == teacher.model.emb_features // 2
    assert student.model.num_layers < teacher.model.num_layers

    hf = transformers.AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    hf.eval()
    assert hf.config.model_type == "llama"
    assert hf.config.hidden_size == student.model.emb_features
    texts = ["dew trains jax", "on one cpu or a pod"]
    ids = np.zeros((len(texts), 16), np.int64)
    for row, text in zip(ids, texts, strict=True):  # full rows: no padding to mask
        encoded = (student.tokenizer.encode(text) * 4)[:16]
        row[:] = encoded
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    got = jax.jit(student.model.apply)({"params": student.params}, ids.astype(np.int32))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
