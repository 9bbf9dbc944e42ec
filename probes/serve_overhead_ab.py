"""Our AR server from several checkouts side by side: the peer probe's workload (probes/peer_vllm_cpu.py: 8 GSM8K chat
prompts, 32 = the 8 four times, 128 tokens, greedy, all at once from threads), the order rotated each round, and per
measurement the server's CPU seconds by thread, its context switches, the client's CPU and the machine's steal time
(the event loop's thread is the one with little CPU; the other two are the engine thread and its OpenMP worker).

    python probes/serve_overhead_ab.py --checkouts base=/tmp/base,new=$PWD --rounds 3 --out results/.../ab.json

A checkout is a directory holding ``specpilot/`` (``git archive COMMIT specpilot | tar -x -C DIR``), put first on the
server's PYTHONPATH. Outputs are compared with the first measurement at each concurrency (``equal_ref``).
"""
import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_vllm_cpu as P

TICK = os.sysconf("SC_CLK_TCK")

def threads_cpu(pid):
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            st = (t / "stat").read_text()
            name = (t / "comm").read_text().strip()
        except OSError:
            continue
        f = st.rsplit(")", 1)[1].split()
        out[f"{name}:{t.name}"] = (int(f[11]) + int(f[12])) / TICK
    return out

def ctx_switches(pid):
    tot = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            s = (t / "status").read_text()
        except OSError:
            continue
        for line in s.splitlines():
            if "ctxt_switches" in line:
                k, v = line.split(":")
                tot[k] = tot.get(k, 0) + int(v)
    return tot

def steal():
    f = open("/proc/stat").readline().split()
    return int(f[8]) / TICK

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkouts", required=True, help="label=path,...")
    ap.add_argument("--conc", default="8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8401)
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra", default="")
    a = ap.parse_args()
    ps = P.prompts(8)
    servers = {}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    res = {"args": vars(a), "runs": []}
    try:
        for i, spec in enumerate(a.checkouts.split(",")):
            label, path = spec.split("=")
            port = a.port + i
            env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=path)
            cmd = [sys.executable, "-m", "specpilot", "serve", "--target", "/work/smollm2", "--threads", "2",
                   "--max-num-seqs", "32", "--max-model-len", "1024", "--drafter", "none", "--log-level", "warning",
                   "--port", str(port)] + (a.extra.split() if a.extra else [])
            log = open(Path(a.out).with_name(f"{Path(a.out).stem}_{label}.log"), "w")
            p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp")
            P.wait_up(port, p, 600)
            P.measure(port, ps[:1], 1, 8)
            servers[label] = (p, port)
            print(label, "up", flush=True)
        names = list(servers)
        ref = {}
        for conc in [int(c) for c in a.conc.split(",")]:
            for rnd in range(a.rounds):
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                for label in order:
                    p, port = servers[label]
                    c0, cs0 = threads_cpu(p.pid), ctx_switches(p.pid)
                    st0 = steal()
                    ru0 = resource.getrusage(resource.RUSAGE_SELF)
                    m = P.measure(port, ps, conc, 128)
                    ru1 = resource.getrusage(resource.RUSAGE_SELF)
                    c1, cs1 = threads_cpu(p.pid), ctx_switches(p.pid)
                    th = {k: round(c1[k] - c0.get(k, 0), 2) for k in c1 if c1[k] - c0.get(k, 0) > 0.05}
                    texts = [o["text"] for o in m["outputs"]]
                    ref.setdefault(conc, texts)
                    r = {"label": label, "conc": conc, "round": rnd, "tok_s": round(m["aggregate_tok_s"], 1),
                         "wall": round(m["wall_s"], 2), "tokens": m["completion_tokens"],
                         "server_cpu": round(sum(th.values()), 2), "threads": th,
                         "client_cpu": round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 2),
                         "ctxsw": {k: cs1[k] - cs0[k] for k in cs1}, "equal_ref": texts == ref[conc],
                         "load": m["loadavg_before"][0], "steal_s": round(steal() - st0, 2)}
                    res["runs"].append(r)
                    print(json.dumps(r), flush=True)
                    Path(a.out).write_text(json.dumps(res, indent=1))
    finally:
        for p, _ in servers.values():
            p.terminate()
        for p, _ in servers.values():
            p.wait(30)


if __name__ == "__main__":
    main()
