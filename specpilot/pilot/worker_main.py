"""Entry script of one controller worker process (§3.3); the parent runs the *stock* copy by file path.

Never import this module from candidate code: the parent (:mod:`specpilot.pilot.workers`) starts it as
``python -u <stock tree>/specpilot/pilot/worker_main.py``. Order of events, which is the point:

1. The clock (``time.perf_counter``) and the thread listing (``threading.enumerate``) are bound at the
   top of this file; torch is imported and the device synchronisation (``torch.cuda.synchronize`` or a
   no-op on the CPU) is bound — all before any candidate code is importable.
2. File descriptor 1 is moved to a private descriptor for the protocol and fd 1 is pointed at stderr, so
   a candidate's ``print`` cannot forge or corrupt a reply.
3. Only then is the source tree named by the parent put first on ``sys.path`` (this script's own
   directory is removed from it) and ``specpilot`` imported from it; a tree whose ``specpilot`` does not
   come from that directory is refused.

Protocol: JSON lines. The first line from the parent is the init message ``{"tree", "device", "dtype",
"target", "drafter", "blocks", "threads"}``; the worker loads the deployment and answers ``{"ok": true,
"vocab_size", "specpilot"}``. Then requests, one reply each:

- ``{"op": "build", "config": {SystemConfig fields}, "key": str}``: build a system under ``key`` (untimed;
  default key ``""``; a worker holds several, one per key) -> ``{"ok": true, "outside": [thread names it
  left running]}``.
- ``{"op": "run", "prompt": [int], "max_new": int, "key": str}``: one timed ``generate`` of the system built
  under ``key`` (clock + reading every token into a host list + device sync) -> ``{"ok": true, "tokens":
  [int], "seconds": float, "outside": [...]}``.
- ``{"op": "drop"}``: free every system built (the worker goes back to a pool) -> ``{"ok": true}``.
- ``{"op": "quit"}``: exit.

Any exception is answered ``{"ok": false, "error": "<Type>: <message>"}`` and the worker stays usable.
"""

import json
import os
import sys
import threading
import time

_clock = time.perf_counter
_enum = threading.enumerate


def _send(out, msg: dict) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def _error(e: BaseException) -> dict:
    text = str(e).strip().splitlines()
    return {"ok": False, "error": f"{type(e).__name__}: {text[0] if text else ''}"[:500]}


def main() -> None:
    """Serve the protocol above on stdin / the private copy of stdout until ``quit`` or EOF."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inp = sys.stdin
    init = json.loads(inp.readline())
    import torch  # not candidate code: imported before the candidate tree is on sys.path

    torch.set_num_threads(max(1, int(init.get("threads") or torch.get_num_threads())))
    dev = torch.device(init["device"])
    if dev.type == "cuda":
        if dev.index is not None:
            torch.cuda.set_device(dev)  # Triton launches on the current device: make it this worker's
        _cuda_sync = torch.cuda.synchronize

        def _sync(_s=_cuda_sync, _d=dev):
            _s(_d)
    else:
        def _sync():
            return None

    here = os.path.dirname(os.path.abspath(__file__))
    tree = os.path.abspath(init["tree"])
    sys.path[:] = [tree] + [p for p in sys.path if os.path.abspath(p or ".") not in (here, tree)]
    try:
        import specpilot

        where = os.path.dirname(os.path.abspath(specpilot.__file__))
        if where != os.path.join(tree, "specpilot"):
            raise ImportError(f"specpilot imported from {where}, not from the tree {tree}")
        from specpilot.config import SystemConfig
        from specpilot.engine.deployment import Deployment

        extra = {k: v for k, v in (("aligned", init.get("aligned")), ("eagle3_dirs", init.get("eagle3"))) if v}
        dep = Deployment(init["target"], init.get("drafter"), dtype=init["dtype"], device=init["device"],
                         block_dirs=init.get("blocks") or (), **extra)  # options a tree of older code lacks: only if set
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which rejects the candidate
        _send(out, _error(e))
        return
    _send(out, {"ok": True, "vocab_size": dep.target.args.vocab_size, "specpilot": where, "pid": os.getpid()})
    systems, simulated = {}, {}  # key -> system; key -> built as a 'calibrated' (simulated) system
    for line in inp:
        try:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "quit":
                _send(out, {"ok": True})
                return
            if op == "drop":
                systems.clear()
                simulated.clear()
                _send(out, {"ok": True})
            elif op == "build":
                before = set(_enum())
                key = str(msg.get("key", ""))
                systems[key] = dep.system(SystemConfig(**msg["config"]))  # kept on failure
                simulated[key] = msg["config"].get("drafter") == "calibrated"
                _send(out, {"ok": True, "outside": sorted(t.name for t in _enum() if t not in before)})
            elif op == "run":
                system = systems.get(str(msg.get("key", "")))
                if system is None:
                    raise RuntimeError(f"run before build of system {msg.get('key', '')!r}")
                prompt, max_new = [int(t) for t in msg["prompt"]], int(msg["max_new"])
                if simulated.get(str(msg.get("key", ""))):  # a simulation's untimed setup (Engine.prepare)
                    system.prepare(prompt, max_new)
                before = set(_enum())
                t0 = _clock()
                gen = system.generate(prompt, max_new)
                tokens = [int(t) for t in gen.tokens]
                _sync()
                dt = _clock() - t0
                left = sorted(t.name for t in _enum() if t not in before)
                _send(out, {"ok": True, "tokens": tokens, "seconds": dt, "outside": left})
            else:
                raise ValueError(f"unknown op {op!r}")
        except BaseException as e:  # noqa: BLE001 - the error text goes back; the worker stays usable
            _send(out, _error(e))


if __name__ == "__main__":
    main()
