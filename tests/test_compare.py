"""The comparison of issue "The paper's comparisons": a very short version, end to end."""
import csv
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import compare  # noqa: E402

pytestmark = pytest.mark.slow  # every test here trains models or runs processes


def weights(path):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_quick_comparison_end_to_end(tmp_path, capsys):
    out = tmp_path / "cmp"
    first = compare.main(["--quick", "--out", str(out)])
    # --resume reuses every finished run and reports the same curves
    capsys.readouterr()
    assert compare.main(["--quick", "--out", str(out), "--resume"]) == first
    printed = capsys.readouterr().out
    assert printed.count("reused ") == 2 + len(compare.ARMS) * 2 and "start " not in printed
    md = (out / "results.md").read_text()
    for arm in compare.ARMS:
        assert f"| {arm} |" in md
    assert "--mode main-only" in md and "--unsync" in md  # every command is written down
    with open(out / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(compare.ARMS) * 2 * 3  # arms x seeds x evaluations (steps 0, 2, 4)
    assert {r["step"] for r in rows} == {"0", "2", "4"}
    # The three arms of the two-agent system start from the one stage-1 checkpoint:
    # before any stage-2 step they evaluate alike, seed by seed.
    start = {(r["arm"], r["seed"]): r["sampled_success"] for r in rows if r["step"] == "0"}
    for seed in ("1", "2"):
        assert start[("co-train", seed)] == start[("co-train unsync", seed)] == start[("main-only", seed)]
    # main-only leaves S as stage 1 made it; co-training moves it
    s1 = weights(out / "stage1-system" / "sub")
    assert same(s1, weights(out / "main-only-seed1" / "sub"))
    assert not same(s1, weights(out / "co-train-seed1" / "sub"))
    assert not same(weights(out / "stage1-system" / "main"), weights(out / "main-only-seed1" / "main"))
    try:
        import matplotlib  # noqa: F401  (optional: the plot is drawn only when it is installed)
        assert (out / "curves.png").stat().st_size > 1000 and "![curves](curves.png)" in md
    except ImportError:
        assert "no plot" in md
