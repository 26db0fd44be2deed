"""tutorial.md's python blocks run in order, and print exactly the ```text block after them."""
import contextlib
import io
import os
import re

TUTORIAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tutorial.md")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def python_blocks():
    """(code, expected output or '') for each python block; the output is the text block
    that directly follows it."""
    with open(TUTORIAL) as f:
        text = f.read()
    fences = list(FENCE.finditer(text))
    out = []
    for a, b in zip(fences, fences[1:] + [None]):
        if a.group(1) == "python":
            follows = b is not None and b.group(1) == "text" and not text[a.end():b.start()].strip()
            out.append((a.group(2), b.group(2) if follows else ""))
    return out


def test_tutorial_code_blocks_run_and_print_what_the_text_says():
    blocks = python_blocks()
    assert len(blocks) >= 3
    namespace = {}
    for i, (code, expected) in enumerate(blocks):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, f"tutorial.md block {i + 1}", "exec"), namespace)
        assert buf.getvalue().strip() == expected.strip(), f"block {i + 1}:\n{code}"
