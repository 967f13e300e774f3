"""SGLang frontend programs against a running server; prints one JSON object with the results.

``tests/test_sglang_frontends.py`` runs this file in a subprocess, once with the pinned ``sglang``
(the dev extra) and once with the newest release on ``PYTHONPATH`` (installed without its GPU
server dependencies, docs/server.md), so the same programs are checked against both frontends.

    python tests/sglang_frontend_program.py URL ITEMS_JSON

``ITEMS_JSON`` is a file with a list of ``{"prefix", "question", "answer"}`` items of the bundled
few-shot task (``bicache_sgl.training.task.heldout_items``).
"""

from __future__ import annotations

import json
import re
import sys

import sglang as sgl

DIGITS = [str(d) for d in range(10)]


@sgl.function
def qa(s, prefix, question):
    s += prefix + "\n\nQuestion: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=32, stop=["\n", "Question"], temperature=0)


@sgl.function
def structured(s, prefix, question):
    s += prefix + "\n\nQuestion: " + question + "\nAnswer: "
    s += sgl.gen("digit", max_tokens=8, regex="[0-9]", temperature=0)
    s += "\n\nQuestion: " + question + "\nAnswer: " + sgl.select("choice", choices=DIGITS)


@sgl.function
def forked(s, prefix, questions):
    s += prefix + "\n\n"
    forks = s.fork(len(questions))
    for f, q in zip(forks, questions):
        f += "Question: " + q + "\nAnswer:"
        f += sgl.gen("answer", max_tokens=32, stop="\n", temperature=0)
    forks.join()
    s += "Answers:" + "".join(f["answer"] for f in forks)
    return [f["answer"] for f in forks]  # the state's ret_value: each branch's own answer


def main() -> None:
    url, items_path = sys.argv[1], sys.argv[2]
    with open(items_path) as f:
        items = json.load(f)
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    args = [{"prefix": it["prefix"], "question": it["question"]} for it in items]

    batch = qa.run_batch(args, num_threads=4)
    single = structured.run(**args[0])
    fam = [it for it in items if it["prefix"] == items[0]["prefix"]]
    tree = forked.run(prefix=items[0]["prefix"], questions=[it["question"] for it in fam[:3]])
    errors = [str(st.error()) for st in [*batch, single, tree] if st.error() is not None]
    out = {
        "version": sgl.__version__,
        "file": sgl.__file__,
        "labels": [it["answer"] for it in items],
        "batch": [st["answer"].strip() for st in batch],
        "batch_cached_tokens": [st.get_meta_info("answer")["cached_tokens"] for st in batch],
        "regex": single["digit"],
        "regex_ok": re.fullmatch("[0-9]", single["digit"]) is not None,
        "select": single["choice"],
        "fork_labels": [it["answer"] for it in fam[:3]],
        "fork": [f.strip() for f in re.findall(r" ?\d", tree.text().rsplit("Answers:", 1)[-1])],
        "fork_answers": tree.ret_value,
        "fork_text": tree.text().rsplit("Answers:", 1)[-1],
        "errors": errors,
    }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
