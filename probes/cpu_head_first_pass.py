"""The certified head on the CPU: its bf16 first pass (``specpilot.head.cpu``) against the plain prepacked float32
head, SmolLM2 float32, 2 torch threads.

1. Head alone, on SmolLM2's final hidden states of real text (3 GSM8K, 3 MT-Bench and 3 HumanEval chat prompts with
   their 96-token greedy continuations): survivors per row, rows the bound leaves undecided, argmax equal to the
   plain head's; time per call at 1 / 8 / 32 rows over consecutive chunks of those rows (plain, certified, the bf16
   GEMM alone, and the INT8 pass ``aten._weight_int8pack_mm`` for the record).
2. In the batched engine (``Deployment.batch_system``, AR, compiled stack, prefix reuse off), 8 GSM8K chat prompts x
   128 new tokens, and one request at a time (the batched engine of 1 slot, 4 prompts): plain vs ``lm_head_int8``,
   alternating P C, C P, ... (``ROUNDS`` pairs, default 3); tokens per second and the median full step; outputs
   equal token for token.

    python probes/cpu_head_first_pass.py SMOLLM2_DIR OUT.json
"""

import json
import os
import statistics
import sys
import time

import torch

from specpilot.config import SystemConfig
from specpilot.data.benchmarks import PROMPTS_DIR
from specpilot.engine.batch import Request
from specpilot.engine.deployment import Deployment
from specpilot.head.certified import CertifiedInt8Head
from specpilot.provenance import git_commit

torch.set_num_threads(2)


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def questions(name, n, key):
    lines = (PROMPTS_DIR / name).read_text().splitlines()[:n]
    out = []
    for ln in lines:
        d = json.loads(ln)
        out.append(d["turns"][0] if key == "turns" else d[key])
    return out


def per_call_ms(fn, reps=3):
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def head_alone(dep, tok) -> dict:
    t = dep.target
    texts = (questions("gsm8k_test.jsonl", 3, "question") + questions("mt_bench_questions.jsonl", 3, "turns")
             + questions("humaneval.jsonl", 3, "prompt"))
    eng = dep.system(SystemConfig.ar())
    hs = []
    with torch.inference_mode():
        for text in texts:
            ids = chat(tok, text)
            seq = list(ids) + list(eng.generate(ids, 96).tokens)
            hid = t.forward(torch.tensor(seq), torch.arange(len(seq)), t.new_cache(len(seq) + 1), 0)
            hs.append(hid[len(ids) - 1:])
    h = torch.cat(hs)
    w = t.lm_head.weight.detach()
    b0 = time.perf_counter()
    head = CertifiedInt8Head(w)
    build_s = time.perf_counter() - b0
    with torch.inference_mode():
        equal = bool(torch.equal(head.argmax(h, full=t.full_greedy), t.full_greedy(h)))
    st = head.stats
    res = {"rows": h.shape[0], "build_s": round(build_s, 2), "argmax_equal": equal,
           "survivors_per_row": round(st.survivors / st.rows, 3), "undecided_rows": st.undecided_rows,
           "max_survivors": int(st.last_survivors.max()), "by_rows": {}}
    s = w.abs().amax(1) / 127
    q = torch.round(w / s[:, None]).to(torch.int8)
    with torch.inference_mode():
        for r in (1, 8, 32):
            chunks = [h[i:i + r].contiguous() for i in range(0, h.shape[0] - r + 1, r)][:48]
            head.stats.full_head_calls = 0
            plain = per_call_ms(lambda: [t.full_greedy(x) for x in chunks]) / len(chunks)
            cert = per_call_ms(lambda: [head.argmax(x, full=t.full_greedy) for x in chunks]) / len(chunks)
            gemm = per_call_ms(lambda: [head.cpu_first_pass.logits(x) for x in chunks]) / len(chunks)
            pack8 = per_call_ms(lambda: torch.ops.aten._weight_int8pack_mm(chunks[0], q, s), reps=2)
            res["by_rows"][r] = {"calls": len(chunks), "plain_ms": round(plain, 3), "certified_ms": round(cert, 3),
                                 "bf16_gemm_ms": round(gemm, 3), "int8pack_mm_ms": round(pack8, 3),
                                 "full_head_calls_per_call": round(head.stats.full_head_calls / (4 * len(chunks)), 4),
                                 "ratio": round(cert / plain, 3)}
            print("head rows", r, res["by_rows"][r], flush=True)
    return res


def in_engine(dep, tok, slots: int, prompts: list, new: int) -> dict:
    engines = {k: dep.batch_system(SystemConfig.ar(lm_head_int8=k == "certified"), max_num_seqs=slots,
                                   max_len=1024, prefix_caching=False, compile_cpu=True)
               for k in ("plain", "certified")}
    for e in engines.values():
        e.compile_shapes()

    def run(name, tag):
        eng = engines[name]
        for i, p in enumerate(prompts):
            eng.add_request(Request(f"{tag}{i}", list(p), new))
        steps, outs, t0 = [], {}, time.perf_counter()
        while eng.has_work():
            s0, b = time.perf_counter(), eng.prefill_passes
            for o in eng.step():
                outs.setdefault(o.request_id[len(tag):], []).extend(o.new_tokens)
            if eng.prefill_passes == b and len(eng._running) == min(slots, len(prompts)):
                steps.append(time.perf_counter() - s0)
        wall = time.perf_counter() - t0
        n = sum(len(v) for v in outs.values())
        step = round(1e3 * statistics.median(steps), 2)
        return {"tok_s": round(n / wall, 2), "tokens": n, "step_ms_median": step}, outs

    runs, outs = {"plain": [], "certified": []}, []
    for rnd in range(int(os.environ.get("ROUNDS", 3))):
        for name in (("plain", "certified") if rnd % 2 == 0 else ("certified", "plain")):
            r, o = run(name, f"{name}{rnd}-")
            runs[name].append(r)
            outs.append(o)
            print(slots, name, rnd, r, flush=True)
    med = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    head = engines["certified"].target.int8_head
    return {"slots": slots, "rounds": len(runs["plain"]), "requests": len(prompts), "max_new_tokens": new, "runs": runs,
            "median_tok_s": med, "ratio": round(med["certified"] / med["plain"], 3),
            "outputs_equal": all(o == outs[0] for o in outs),
            "head_undecided_rows": head.stats.undecided_rows, "head_rows": head.stats.rows}


def main(model_dir: str, out: str) -> None:
    from transformers import AutoTokenizer

    load = {"before": os.getloadavg()}
    dep, tok = Deployment(model_dir), AutoTokenizer.from_pretrained(model_dir)
    res = {"probe": "probes/cpu_head_first_pass.py", "device": "cpu", "torch": torch.__version__,
           "commit": git_commit(), "threads": torch.get_num_threads(), "model": model_dir, "dtype": "float32"}
    res["head"] = head_alone(dep, tok)
    gsm = [chat(tok, q) for q in questions("gsm8k_test.jsonl", 8, "question")]
    res["engine_8"] = in_engine(dep, tok, 8, gsm, 128)
    res["engine_1"] = in_engine(dep, tok, 1, gsm[:4], 64)
    load["after"] = os.getloadavg()
    res["loadavg_1_5_15"] = load
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("engine_8", "engine_1")}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
