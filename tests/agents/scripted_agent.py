"""A scripted stand-in for an external coding agent (tests of ``--agent``): it reads nothing but
its mode, edits the worktree it is given and exits. Usage: ``scripted_agent.py MODE BRIEF WORKTREE``.

Modes: ``unslow`` removes the lines marked ``SPECPILOT-TEST-SLEEP`` (a planted slowdown of the incumbent's
code: output unchanged, faster); ``slow`` plants that slowdown; ``bias`` adds +1.5 to the logits of every
7th token id in the engine's exact pass (output changes: token forcing must reject it); ``controller``
edits specpilot/pilot/controller.py (outside the allowlist); ``nothing`` changes nothing; ``fail`` exits
with status 3; ``hang`` sleeps for a minute (timeout).
"""

import sys
import time
from pathlib import Path

MARK = "SPECPILOT-TEST-SLEEP"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {path}"
    path.write_text(text.replace(old, new))


def main() -> None:
    mode, brief, tree = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    assert brief.is_file() and (brief.parent / "brief.json").is_file()
    engine = tree / "specpilot" / "engine" / "engine.py"
    if mode == "slow":
        edit(engine, "        feats: list[torch.Tensor] = []\n",  # the eager exact pass (_argmax)
             f"        __import__('time').sleep(0.004)  # {MARK}\n        feats: list[torch.Tensor] = []\n")
    elif mode == "unslow":
        lines = engine.read_text().splitlines(keepends=True)
        engine.write_text("".join(ln for ln in lines if MARK not in ln))
    elif mode == "bias":
        edit(engine, "        self.logits_hook = logits_hook\n",
             "        self.logits_hook = logits_hook or (lambda z: z + (__import__('torch').arange(z.shape[-1], "
             "device=z.device) % 7 == 0).to(z.dtype) * 1.5)\n")
    elif mode == "controller":
        edit(tree / "specpilot" / "pilot" / "controller.py", "BASE_BAR = 0.01", "BASE_BAR = -1.0")
    elif mode == "fail":
        print("scripted agent: giving up")
        sys.exit(3)
    elif mode == "hang":
        time.sleep(60)
    elif mode != "nothing":
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
