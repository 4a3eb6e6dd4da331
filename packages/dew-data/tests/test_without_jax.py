"""dew-data works with jax absent: nothing imports it, and the readers run without it.
Without the [hf] extra (datasets, pillow, tokenizers, pyarrow, safetensors) it imports
and reads text, prompt/completion rows, chat rows with a template (jinja2 is a dependency
of dew-data) and .npy clips, and what needs the extra says how to install it, with pip
and with uv."""

import ast
import pathlib
import subprocess
import sys
import textwrap

SOURCE = pathlib.Path(__file__).parents[1] / "src" / "dew" / "data"
FORBIDDEN = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax",
    "dew.nn",
    "dew.train",
    "dew.objectives",
    "dew.sampling",
)


def imported_modules(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_no_module_imports_jax_or_a_higher_package():
    found = {
        (path.name, name)
        for path in SOURCE.glob("*.py")
        for name in imported_modules(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    }
    assert not found


def test_readers_run_with_jax_blocked(tmp_path):
    script = textwrap.dedent("""
        import sys
        for name in ("jax", "jaxlib", "flax", "datasets", "PIL", "tokenizers", "pyarrow"):
            sys.modules[name] = None  # any import of them now fails
        import numpy as np
        from dew.data import HFImages, HFTokenizer, Partition, SFTExamples, TokenWindows, Videos

        open("corpus.txt", "w").write("no jax needed here. " * 20)
        data = TokenWindows("corpus.txt", seq_len=8, cache_dir="cache").load(batch=4)
        iterator = data.train(Partition(1, 2))
        next(iterator)
        state = iterator.get_state()
        expected = next(iterator)["text"]
        fresh = data.train(Partition(1, 2))
        fresh.set_state(state)
        assert (next(fresh)["text"] == expected).all()
        np.save("clip.npy", np.zeros((4, 2, 2, 3), np.uint8))
        assert next(Videos("clip.npy", frames=2).load(batch=2).train(Partition()))[
            "video"].shape == (2, 2, 2, 2, 3)
        open("sft.jsonl", "w").write('{"prompt": "2+2=", "completion": "4"}\\n')
        sft = next(SFTExamples("sft.jsonl", seq_len=15).load(batch=1).train(Partition()))
        assert sft["loss_mask"].sum() == 2  # "4" and the end id
        open("chat.jsonl", "w").write(
            '{"messages": [{"role": "user", "content": "hi"}, '
            '{"role": "assistant", "content": "yo"}]}\\n'
        )
        template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}"
        chat = next(SFTExamples("chat.jsonl", seq_len=31, chat_template=template).load(
            batch=1).train(Partition()))
        assert bytes(chat["text"][0][chat["loss_mask"][0]].tolist()) == b"assistant: yo\\n"
        assert "jax" not in [m for m in sys.modules if sys.modules[m] is not None]
        for needs_the_extra in (
            lambda: HFTokenizer("tokenizer.json"),
            lambda: HFImages("images").load(batch=1),
            lambda: next(Videos("clip.npy", frames=2, size=1).load(batch=2).train(Partition())),
        ):
            try:
                needs_the_extra()
                raise AssertionError("expected an ImportError")
            except ImportError as error:
                for command in ('pip install "dew-data[', 'uv add "dew-data[', "uv sync --all"):
                    assert command in str(error), error
        print("ok")
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
