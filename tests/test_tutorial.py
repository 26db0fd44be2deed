"""tutorial.md's python blocks run in order, and print exactly the ```text block after them; its
table of equations names, for each, a function of mgrpo.py that cites it."""
import contextlib
import inspect
import io
import os
import re
import textwrap
import tokenize

import mgrpo

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


def comments(function):
    """The comments (the text after '#') in a function's source."""
    source = io.StringIO(textwrap.dedent(inspect.getsource(function)))
    return [t.string for t in tokenize.generate_tokens(source.readline) if t.type == tokenize.COMMENT]


def test_each_equation_of_the_table_is_cited_by_the_function_it_names():
    """The table names, per equation, the function of mgrpo.py that computes it; a comment on
    the computing line there carries `eq. N` (a block of equations: `eq. first-last`)."""
    with open(TUTORIAL) as f:
        rows = re.findall(r"^\| (\d+(?:-\d+)?) \| (.*?) \| (.*?) \|$", f.read(), re.M)
    numbers = set()
    for eq, _, where in rows:
        first, last = (int(x) for x in (eq.split("-") * 2)[:2])
        numbers.update(range(first, last + 1))
        if "no code" in where:
            continue
        cited = " ".join(comments(getattr(mgrpo, re.search(r"`(\w+)`", where).group(1))))
        assert f"eq. {eq}" in cited, (eq, where)
    assert numbers == set(range(1, 20))  # every equation of the paper, 1 to 19, has its row
