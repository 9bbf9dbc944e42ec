"""Is the drafter training text disjoint from every evaluation prompt? Word 13-gram overlap (GPT-3's
contamination test) between ``corpus.txt`` (``specpilot zoo corpus``: stdlib source + GSM8K train) and every
record of the evaluation prompt files (GSM8K test, HumanEval, MBPP, MT-Bench: the bundled copies in
``specpilot/data/prompts`` and the full files in ``../shared/data/prompts``).

Usage: ``python probes/corpus_disjoint.py CORPUS.txt OUT.json [PROMPT_DIR ...]``. Writes, per prompt file, the
records whose text shares at least one 13-gram with the corpus, with the shared n-grams (lowercased words).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

N = 13
FIELDS = {"gsm8k_test.jsonl": ("question",), "humaneval.jsonl": ("prompt",), "mbpp_sanitized.jsonl": ("text", "prompt", "test_list"),
          "mt_bench_questions.jsonl": ("turns",)}


def words(text: str) -> list[str]:
    """Lowercased word tokens (letters, digits, underscores); punctuation and whitespace dropped."""
    return re.findall(r"\w+", text.lower())


def ngrams(ws: list[str]) -> set[tuple[str, ...]]:
    return {tuple(ws[i : i + N]) for i in range(len(ws) - N + 1)}


def record_text(rec: dict, fields: tuple[str, ...]) -> str:
    parts = []
    for f in fields:
        v = rec.get(f)
        parts += v if isinstance(v, list) else [v] if v else []
    return "\n".join(str(p) for p in parts)


def main() -> None:
    corpus, out, *dirs = sys.argv[1:]
    dirs = dirs or ["specpilot/data/prompts", str(Path(__file__).resolve().parents[2] / "shared/data/prompts")]
    text = Path(corpus).read_text(encoding="utf-8")
    ws = words(text)
    grams = {tuple(ws[i : i + N]) for i in range(len(ws) - N + 1)}
    res = {"corpus": str(corpus), "corpus_words": len(ws), "n": N, "files": {}}
    for d in dirs:
        for name, fields in FIELDS.items():
            p = Path(d) / name
            if not p.is_file():
                continue
            recs = [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]
            hits = []
            for i, r in enumerate(recs):
                shared = sorted(g for g in ngrams(words(record_text(r, fields))) if g in grams)
                if shared:
                    hits.append({"index": i, "shared_ngrams": len(shared), "examples": [" ".join(g) for g in shared[:3]]})
            res["files"][str(p)] = {"records": len(recs), "records_with_shared_13gram": len(hits), "hits": hits}
            print(f"{p}: {len(recs)} records, {len(hits)} share a 13-gram with the corpus", flush=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
