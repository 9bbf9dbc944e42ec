"""The command line: ``generate --json`` and one-line errors (no traceback) for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


from .conftest import save_tiny, run_cli



def test_generate_json_bundled(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "def add(a, b):", "--drafter", "ngram",
                             "--tree", "best_first", "--nodes", "8", "--max-new-tokens", "16", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert len(res["tokens"]) <= 16 and res["steps"] >= 1 and res["tau"] >= 1.0 and isinstance(res["text"], str)


def test_generate_matches_ar(monkeypatch, capsys):
    outs = []
    for drafter in ("none", "draft_model"):
        code, out, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "Question: 3 + 4 =", "--drafter", drafter,
                                 "--max-new-tokens", "20", "--json")
        assert code == 0, err
        outs.append(json.loads(out)["tokens"])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("case", ["missing", "model_type", "empty", "too_long", "vocab", "bad_tree"])
def test_bad_input_is_one_line_error(monkeypatch, capsys, tmp_path, case):
    args = ["generate", "--prompt", "hello", "--max-new-tokens", "4"]
    if case == "missing":
        args += ["--target", str(tmp_path / "nope")]
    elif case == "model_type":
        d = tmp_path / "gpt2ish"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        args += ["--target", str(d)]
    elif case == "empty":
        args[2] = ""  # whitespace is text with tokens (test_a_whitespace_prompt_is_text_not_empty)
    elif case == "too_long":
        args[2] = "x = 1\n" * 3000
    elif case == "vocab":
        drafter = save_tiny(tmp_path / "drafter", vocab=97)
        args += ["--drafter", "draft_model", "--drafter-path", drafter, "--target",
                 str(__import__("specpilot.zoo", fromlist=["x"]).bundled_target_dir())]
    elif case == "bad_tree":
        args += ["--tree", "bushy"]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("args,needle", [
    (["generate", "--prompt", "x", "--nodes", "-3"], "--nodes"),
    (["generate", "--prompt", "x", "--dtype", "bogus"], "--dtype"),
    (["generate", "--prompt", "x", "--device", "bogus"], "device"),
    (["generate", "--prompt", "x", "--device", "cuda:7"], "cuda"),
    (["generate", "--prompt", "x", "--top-k", "0"], "--top-k"),  # a chain used to drop it silently
    (["pilot", "--scorer-dtype", "float16", "--out", "/nonexistent-specpilot-out"], "--scorer-dtype"),
])
def test_bad_options_name_the_option(monkeypatch, capsys, args, needle):
    code, out, err = run_cli(monkeypatch, capsys, *args)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


@pytest.mark.parametrize("args", [["generate"], ["generate", "--prompt", "x", "--nodes", "abc"], ["pilot", "--bogus"],
                                  ["pilot", "--per-benchmark", "1"]])  # the last was a traceback after the model load
def test_parser_errors_are_not_tracebacks(monkeypatch, capsys, args):
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and "Traceback" not in err and err.strip()
    if "--per-benchmark" in args:
        assert "--per-benchmark" in err and "greater than or equal to 2" in err


def test_fresh_user_bad_options_are_one_line_errors(monkeypatch, capsys, tmp_path):
    """Found by the third fresh-user test: these used to end in tracebacks."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    from specpilot.zoo import bundled_target_dir

    target = str(bundled_target_dir())
    cases = [("pilot", "--quick", "--dtype", "nonsense", "--out", str(tmp_path / "r")),
             ("pilot", "--quick", "--out", str(afile)),
             ("bench", "--target", target, "--device", "cpu", "--dtype", "nonsense")]
    if not __import__("torch").cuda.is_available():
        cases.append(("bench", "--target", target))
    for args in cases:
        code, out, err = run_cli(monkeypatch, capsys, *args)
        assert code == 2 and err.startswith("error:") and "Traceback" not in err, (args, err)
    code, _, err = run_cli(monkeypatch, capsys, "bench", "--target", str(tmp_path / "missing"))
    _one_line_error(code, err, "checkpoint directory not found")  # named before the (default cuda) device
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--target", str(afile), "--prompt", "hi")
    _one_line_error(code, err, "is a file", "directory")


def _one_line_error(code, err, *needles):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("args,needles", [
    (["replay", "--per-benchmark", "0"], ["--per-benchmark", "at least 1"]),
    (["replay", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], ["--max-new-tokens", "at least 1"]),
    (["pilot", "--quick", "--dtype", "float16", "--device", "cpu"], ["float16", "CPU", "bfloat16"]),
])
def test_fourth_fresh_user_bad_options_rejected(monkeypatch, capsys, tmp_path, args, needles):
    """Fourth fresh-user test: these were accepted (replay of nothing; a slow, meaningless float16 CPU pilot)."""
    if args[0] == "pilot":
        args = args + ["--out", str(tmp_path / "r")]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    _one_line_error(code, err, *needles)
    assert not (tmp_path / "r").exists()


def test_memory_check_bad_repo_rejected(monkeypatch, capsys, tmp_path):
    (tmp_path / "mem").mkdir()
    code, out, err = run_cli(monkeypatch, capsys, "memory", "check", str(tmp_path / "mem"), "--repo", "/nonexistent")
    _one_line_error(code, err, "--repo /nonexistent", "not found")
    (tmp_path / "plain").mkdir()
    code, out, err = run_cli(monkeypatch, capsys, "memory", "check", str(tmp_path / "mem"), "--repo", str(tmp_path / "plain"))
    _one_line_error(code, err, "not a git repository")
    (tmp_path / "afile").write_text("x")
    code, out, err = run_cli(monkeypatch, capsys, "memory", "check", str(tmp_path / "mem"), "--repo", str(tmp_path / "afile"))
    _one_line_error(code, err, "is a file")


def test_files_and_directories_given_for_each_other_are_named(monkeypatch, capsys, tmp_path):
    """Tenth fresh-user run: an existing file or directory of the wrong kind was reported as not found."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    code, out, err = run_cli(monkeypatch, capsys, "pilot", "--quick", "--memory", str(tmp_path / "afile"),
                             "--out", str(tmp_path / "r"))
    _one_line_error(code, err, "--memory", "is a file")
    from specpilot.zoo import bundled_target_dir

    code, out, err = run_cli(monkeypatch, capsys, "audit", "--target", str(bundled_target_dir()), "--outputs",
                             str(tmp_path / "adir"))
    _one_line_error(code, err, "is a directory")


def test_drafter_path_of_the_other_kind_says_what_it_is(monkeypatch, capsys):
    from specpilot.zoo import bundled_block_markov_dir, bundled_drafter_dir

    code, out, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "x", "--drafter", "draft_model",
                             "--drafter-path", str(bundled_block_markov_dir()))
    _one_line_error(code, err, "block drafter", "block_markov", "use --drafter block")
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "x", "--drafter", "block",
                             "--drafter-path", str(bundled_drafter_dir()))
    _one_line_error(code, err, "draft model", "qwen3", "use --drafter draft_model")


def test_pilot_size_flags_reach_the_plan(monkeypatch, capsys, tmp_path):
    """``--per-benchmark / --max-new-tokens / --rounds`` override the plan (on top of ``--quick``)."""
    import specpilot.pilot.run as run

    seen = []
    monkeypatch.setattr(run, "run_pilot", lambda opts: seen.append(opts))
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--quick", "--per-benchmark", "3", "--max-new-tokens", "48",
                           "--rounds", "0", "--out", str(tmp_path / "r"))
    assert code == 0, err
    plan = seen[0].plan
    assert (plan["per_benchmark"], plan["max_new_tokens"], plan["rounds"], plan["candidates"]) == (3, 48, 0, 2)


@pytest.mark.parametrize("args,needles", [
    (["generate", "--prompt", "x", "--device", "mps"], ["'mps' is not supported", "cpu or cuda"]),
    (["generate", "--prompt", "x", "--device", "meta"], ["'meta' is not supported"]),
    (["generate", "--prompt", "x", "--device", "cpu:1"], ["'cpu:1' is not supported"]),
    (["audit", "--target", "TARGET", "--outputs", "README", "--device", "mps"], ["'mps' is not supported"]),
    (["w12", "pack", "TARGET", "README"], ["exists and is not a directory"]),
    (["replay", "--out", "README", "--per-benchmark", "1", "--max-new-tokens", "4"], ["--out", "not a directory"]),
    (["bench", "--target", "TARGET", "--device", "cpu", "--prefix", "100000"], ["--prefix 100000", "context of 2048"]),
    (["bench", "--target", "TARGET", "--device", "cpu", "--new-tokens", "0"], ["--new-tokens must be at least 1"]),
    (["pilot", "--max-new-tokens", "100000", "--out", "NEW"], ["--max-new-tokens 100000", "context of 2048"]),
    (["bench", "--target", "TARGET", "--device", "cpu", "--dtype", "float16", "--out", "NEW"],
     ["--dtype float16 is not supported on the CPU"]),  # its byte floor read 500% (fresh-user run 10)
    (["generate", "--prompt", "x", "--drafter", "ngram", "--drafter-path", "/nope"], ["--drafter-path is for"]),
    (["generate", "--prompt", "x", "--drafter", "block", "--drafter-path", "BLOCK", "--depth", "32"],
     ["at most 16 positions", "depth 32"]),
    (["zoo", "corpus", "--out", "README"], ["--out", "not a directory"]),
    (["train-drafter", "--kind", "block", "--device", "mps", "--out", "NEW"], ["'mps' is not supported"]),
    (["train-drafter", "--kind", "block", "--out", "README"], ["--out", "not a directory"]),
])
def test_eighth_fresh_user_bad_input_is_one_line(monkeypatch, capsys, tmp_path, args, needles):
    """Eighth fresh-user test: tracebacks (another torch device, a file as output dir, a prefix past the
    context), an ignored --drafter-path and a block depth silently clamped to the block size."""
    from specpilot.zoo import bundled_block_dir, bundled_target_dir

    readme = tmp_path / "README.md"
    readme.write_text("a file\n")
    subs = {"TARGET": str(bundled_target_dir()), "README": str(readme), "BLOCK": str(bundled_block_dir()),
            "NEW": str(tmp_path / "new")}
    code, out, err = run_cli(monkeypatch, capsys, *[subs.get(a, a) for a in args])
    _one_line_error(code, err, *needles)
    assert readme.read_text() == "a file\n"


def test_out_under_a_file_or_unwritable_is_refused_before_any_work(monkeypatch, capsys, tmp_path):
    """Fourteenth fresh-user run: ``--out FILE/sub`` passed the is-a-file check and crashed with a traceback
    after the work (pilot after Phase 0, bench after timing); an unwritable --out likewise."""
    from specpilot.zoo import bundled_target_dir

    afile = tmp_path / "afile"
    afile.write_text("x")
    target = str(bundled_target_dir())
    under = str(afile / "sub")
    for args in [("pilot", "--quick", "--out", under), ("replay", "--out", under, "--per-benchmark", "1"),
                 ("bench", "--device", "cpu", "--target", target, "--out", under, "--no-transformers"),
                 ("zoo", "random", "--arch", "qwen3-8b", "--out", under), ("w12", "pack", target, under)]:
        code, _, err = run_cli(monkeypatch, capsys, *args)
        _one_line_error(code, err, "is a file, so no directory can be made under it")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os

        if not os.access(ro, os.W_OK):  # root may write anyway: then only the under-a-file case applies
            code, _, err = run_cli(monkeypatch, capsys, "pilot", "--quick", "--out", str(ro / "r"))
            _one_line_error(code, err, "is not writable here")
    finally:
        ro.chmod(0o700)
    if __import__("pathlib").Path("/proc/self").is_dir():  # a pseudo file system nobody can mkdir in, root included
        code, _, err = run_cli(monkeypatch, capsys, "pilot", "--quick", "--out", "/proc/specpilot-test-out")
        _one_line_error(code, err, "cannot create a directory there")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--quick", "--out", str(link))
    _one_line_error(code, err, "dangling symbolic link")
    assert sorted(tmp_path.iterdir()) == sorted([afile, ro, link])
    assert list(ro.iterdir()) == []  # the writability probe leaves nothing behind


def test_pilot_drafter_path_of_a_block_drafter_is_refused(monkeypatch, capsys, tmp_path):
    """Fourteenth fresh-user run: ``pilot --drafter-path <block drafter>`` ran an n-gram stock silently while
    the report named the block drafter as the deployment's drafter."""
    from specpilot.zoo import bundled_block_dir

    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--quick", "--drafter-path", str(bundled_block_dir()),
                           "--out", str(tmp_path / "r"))
    _one_line_error(code, err, "is a block drafter", "--block")
    assert not (tmp_path / "r").exists()
    code, _, err = run_cli(monkeypatch, capsys, "w12", "verify", str(Path(__file__)))
    _one_line_error(code, err, "is a file, not a W12 directory")


def test_pilot_will_not_overwrite_a_users_files(monkeypatch, capsys, tmp_path):
    """Fresh-user run 16: ``pilot --out ''`` ran in the current directory; a user's report.md there would have been
    overwritten. A directory holding a file a pilot writes is refused unless it holds an earlier pilot report."""
    from specpilot.pilot.cli import check_report_dir
    from specpilot.errors import SpecPilotError

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "report.md").write_text("my report\n")
    code, _, err = run_cli(monkeypatch, capsys, "pilot", "--quick", "--out", str(proj))
    _one_line_error(code, err, "report.md", "no earlier pilot report")
    assert (proj / "report.md").read_text() == "my report\n" and sorted(p.name for p in proj.iterdir()) == ["report.md"]
    (proj / "report.json").write_text('{"deployment": {}, "phase0": {}, "commit": "x"}')
    check_report_dir(proj)  # an earlier pilot's report: rewritten, as the README says
    (proj / "report.json").write_text('["not", "a", "report"]')
    with pytest.raises(SpecPilotError, match="no earlier pilot report"):
        check_report_dir(proj)
    check_report_dir(tmp_path / "new")  # new or free of the pilot's names: fine
    failed = tmp_path / "failed"  # a run that failed after Phase 0 left its outputs and its marker: rerunnable
    (failed / "outputs").mkdir(parents=True)
    (failed / "outputs" / "stock_phase0.jsonl").write_text("{}\n")
    with pytest.raises(SpecPilotError, match="no earlier pilot report"):
        check_report_dir(failed)
    from specpilot.pilot.phase0 import RUN_MARKER

    (failed / RUN_MARKER).write_text("x")
    check_report_dir(failed)
    batch = tmp_path / "batch"  # the batched pilot's report names are the pilot's too
    batch.mkdir()
    (batch / "batch_report.md").write_text("my notes\n")
    with pytest.raises(SpecPilotError, match="batch_report.md"):
        check_report_dir(batch)
    sized = tmp_path / "sized"  # and so are the per-size sealed systems of a batched pilot
    sized.mkdir()
    (sized / "system_n16.json").write_text("{}\n")
    with pytest.raises(SpecPilotError, match="system_n16.json"):
        check_report_dir(sized)


@pytest.mark.parametrize("args, says", [(("pilot", "--per-benchmark", "1"), "Invalid value for '--per-benchmark'"),
                                        (("pilot", "--max-new-tokens", "abc"), "Invalid value for '--max-new-tokens'"),
                                        (("nosuch",), "No such command"),
                                        (("memory", "show", "."), "Missing argument")])
def test_usage_errors_are_one_line(monkeypatch, capsys, args, says):
    """Fresh-user run: the parser's own errors printed click's four-line usage block; now one ``error:`` line that
    names the command's --help, exit 2, as every other error."""
    code, out, err = run_cli(monkeypatch, capsys, *args)
    _one_line_error(code, err, says, "--help')")


def test_train_drafter_refuses_bad_numbers_and_token_files(monkeypatch, capsys, tmp_path):
    """Fresh-user run 26: zero / negative counts and learning rate, a non-.npy, 2-D or out-of-vocabulary token
    file gave raw tracebacks (or, --steps -1, an untrained drafter). Now refused before any work, no --out left."""
    import numpy as np

    for opt, v in (("--steps", "-1"), ("--n-seqs", "0"), ("--batch-size", "0"), ("--anchors", "0"), ("--lr", "-1"),
                   ("--markov-rank", "0"), ("--block", "0"), ("--gen-len", "0"), ("--prompt-len", "0")):
        code, out, err = run_cli(monkeypatch, capsys, "train-drafter", "--out", str(tmp_path / "o"), opt, v)
        assert code == 2 and f"Invalid value for '{opt}'" in out + err, (opt, out + err)
    garbage = tmp_path / "g.txt"
    garbage.write_text("garbage")
    flat = tmp_path / "flat.npy"
    np.save(flat, np.zeros((4, 4), dtype=np.int64))
    big = tmp_path / "big.npy"
    np.save(big, np.full(5000, 10**6, dtype=np.int64))
    for path, needle in ((garbage, "not a .npy array"), (flat, "1-D integer array"), (big, "outside the target")):
        code, out, err = run_cli(monkeypatch, capsys, "train-drafter", "--out", str(tmp_path / "o"), "--tokens",
                                 str(path), "--steps", "1", "--n-seqs", "2")
        _one_line_error(code, err, needle)
    assert not (tmp_path / "o").exists()


@pytest.fixture
def keep_threads():
    """``generate`` sets torch's thread count for its process; restore it for the tests after this one."""
    import torch

    n = torch.get_num_threads()
    yield n
    torch.set_num_threads(n)


@pytest.mark.parametrize("cores, flag, want", [(2, None, 1), (1, None, 1), (64, None, "default"), (2, "3", 3)])
def test_generate_picks_threads_as_the_pilot_does(monkeypatch, capsys, keep_threads, cores, flag, want):
    """``generate`` on a CPU with <= 2 cores runs on 1 thread (2 threads made an AR step 4x slower on a loaded
    2-core machine), else on torch's default; ``--threads N`` overrides. Applied before the model loads."""
    import torch

    import specpilot.pilot.setup as setup

    monkeypatch.setattr(setup, "available_cores", lambda: cores)
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    args = ["generate", "--prompt", "def add(a, b):", "--drafter", "none", "--max-new-tokens", "4", "--json"]
    code, out, err = run_cli(monkeypatch, capsys, *args, *(["--threads", flag] if flag else []))
    assert code == 0, err
    want = keep_threads if want == "default" else want
    assert json.loads(out)["threads"] == want and seen[:1] == [want] and torch.get_num_threads() == want


def test_generate_threads_below_one_is_refused_before_loading(monkeypatch, capsys, keep_threads):
    import specpilot.engine.deployment as deployment

    monkeypatch.setattr(deployment, "Deployment", lambda *a, **k: pytest.fail("loaded a model"))
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "x", "--threads", "0")
    _one_line_error(code, err, "--threads")


def test_a_whitespace_prompt_is_text_not_empty(monkeypatch, capsys, keep_threads):
    """Spaces or a newline tokenize to ids (the Python API takes them), so ``generate`` decodes them too; only an
    empty string is the empty prompt."""
    for prompt in ("   ", "\n"):
        code, out, err = run_cli(monkeypatch, capsys, "generate", "--prompt", prompt, "--max-new-tokens", "3", "--json")
        assert code == 0, err
        assert len(json.loads(out)["tokens"]) >= 1
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "", "--max-new-tokens", "3")
    _one_line_error(code, err, "the prompt is empty")


def test_a_tree_without_a_drafter_is_refused(monkeypatch, capsys, keep_threads):
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--prompt", "x", "--drafter", "none", "--tree", "best_first")
    _one_line_error(code, err, "--tree best_first needs a drafter")
