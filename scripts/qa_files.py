"""The two files of a run on your own questions (docs/own-questions.md), from public data fetched elsewhere:

    python scripts/qa_files.py hotpot hotpot_dev_distractor_v1.json data/    # data/questions.jsonl, data/corpus.jsonl
    python scripts/qa_files.py dpr psgs_w100.tsv data/wiki.jsonl             # a Wikipedia corpus (21M passages)

hotpot: a HotpotQA file (train or dev; distractor or fullwiki) as questions.jsonl, one {"id", "question",
"answers": [answer]} a line (--split marks them all train or test; without it qa_task.py holds out 1 in
10 by a hash), and the paragraphs that come with its questions (2 gold and 8 distractors each, in the
distractor setting), each title once, as corpus.jsonl: {"id", "title", "contents"}. That corpus holds
every question's answer paragraphs: searching it is easier than searching all of Wikipedia.
dpr: DPR's passages (id, text, title, tab-separated, with a header line) as a corpus.
"""
import argparse
import csv
import json
import os
import sys


def hotpot(path, folder, split=None, limit=None):
    """questions.jsonl and corpus.jsonl in folder, from a HotpotQA JSON file; (questions, passages) written."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)[:limit]
    os.makedirs(folder, exist_ok=True)
    titles = {}  # title -> its paragraph, the first seen
    with open(os.path.join(folder, "questions.jsonl"), "w", encoding="utf-8") as out:
        for item in data:
            row = {"id": item["_id"], "question": item["question"], "answers": [item["answer"]]}
            out.write(json.dumps({**row, "split": split} if split else row) + "\n")
            for title, sentences in item["context"]:
                titles.setdefault(title, " ".join(s.strip() for s in sentences))
    with open(os.path.join(folder, "corpus.jsonl"), "w", encoding="utf-8") as out:
        for n, (title, text) in enumerate(titles.items()):
            out.write(json.dumps({"id": n, "title": title, "contents": text}) + "\n")
    return len(data), len(titles)


def dpr(path, out_path):
    """A corpus from DPR's psgs_w100.tsv (id, text, title); the passages written."""
    csv.field_size_limit(sys.maxsize)
    n = 0
    with open(path, encoding="utf-8", newline="") as f, open(out_path, "w", encoding="utf-8") as out:
        rows = csv.reader(f, delimiter="\t")
        next(rows)  # the header: id, text, title
        for doc_id, text, title in rows:
            out.write(json.dumps({"id": doc_id, "title": title, "contents": text}) + "\n")
            n += 1
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["hotpot", "dpr"])
    p.add_argument("source", help="hotpot: a HotpotQA .json file; dpr: psgs_w100.tsv")
    p.add_argument("out", help="hotpot: a folder for questions.jsonl and corpus.jsonl; dpr: the corpus's path")
    p.add_argument("--split", choices=["train", "test"], help="hotpot: mark every question so")
    p.add_argument("--limit", type=int, help="hotpot: the first N questions only")
    a = p.parse_args(argv)
    if a.kind == "hotpot":
        print("%d questions, %d passages" % hotpot(a.source, a.out, a.split, a.limit))
    else:
        print(f"{dpr(a.source, a.out)} passages")


if __name__ == "__main__":
    main()
