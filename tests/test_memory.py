"""Memory entries on disk (§3.5)."""

import json
import subprocess

import pytest

from specpilot.config import SystemConfig
from specpilot.pilot.memory import Entry, Evidence, Memory, MemoryEntryError

from .conftest import run_cli

STOCK = SystemConfig.stock()


def entry(id, delta, requires=(), system=None, **kw):
    return Entry(
        id=id, title=id.replace("-", " "), mechanism=id, requires=list(requires), delta=delta,
        evidence=Evidence(gain=1.1, lower_bound=1.05, bar=0.012, sigma=0.001,
                          forcing={"mismatch_rate": 0.0}, deployment={"device": "cpu"}, date="2025-01-01"),
        base=STOCK.model_dump(), system=(system or STOCK).model_dump(), not_verified=["bf16"], **kw,
    )


@pytest.fixture
def mem(tmp_path):
    m = Memory(tmp_path / "memory")
    tree = STOCK.apply({"tree": "best_first", "top_k": 4})
    big = tree.apply({"nodes": 16})
    m.add(entry("best-first", {"tree": "best_first", "top_k": 4}, system=tree))
    m.add(entry("budget-16", {"nodes": 16}, requires=["best-first"], system=big))
    return m, tree, big


def test_round_trip(mem, tmp_path):
    m, tree, _ = mem
    assert m.ids() == ["best-first", "budget-16"]
    assert (tmp_path / "memory" / "best-first" / "entry.json").is_file()
    e = m.get("budget-16")
    assert e.requires == ["best-first"] and e.status == "approved" and e.evidence.gain == 1.1
    assert e.contract == "output == AR in float32; token forcing passes" and e.not_verified == ["bf16"]
    assert [x.id for x in m.list()] == ["best-first", "budget-16"]
    assert Memory(tmp_path / "memory").get("best-first") == m.get("best-first")  # from disk, not cache
    with pytest.raises(MemoryEntryError):
        m.add(entry("best-first", {}))
    m.add(entry("best-first", {"tree": "best_first", "top_k": 4}, system=tree, reused_from="h100"), overwrite=True)
    assert m.get("best-first").reused_from == "h100"
    with pytest.raises(MemoryEntryError):
        m.get("nope")
    assert Memory(tmp_path / "empty").list() == []


def test_apply_with_requirements(mem):
    m, tree, big = mem
    assert m.apply(STOCK, ["budget-16"]) == big  # requirement applied first
    assert m.apply(STOCK, ["best-first"]) == tree
    assert [e.id for e in m.order(["budget-16", "best-first"])] == ["best-first", "budget-16"]
    assert m.apply(STOCK, []) == STOCK


def test_reproduction_check(mem, tmp_path):
    m, tree, big = mem
    assert m.check("budget-16", big) and m.check("budget-16") and m.check("best-first", tree)
    assert not m.check("budget-16", tree)
    res = m.check_all(STOCK, big)
    assert res.ok and res.entries == {"best-first": True, "budget-16": True}
    assert not m.check_all(STOCK, tree).ok
    # tamper with the delta on disk: the entry no longer reproduces its approved system
    f = tmp_path / "memory" / "budget-16" / "entry.json"
    d = json.loads(f.read_text())
    d["delta"] = {"nodes": 15}
    f.write_text(json.dumps(d))
    assert not m.check("budget-16") and not m.check_all(STOCK, big).entries["budget-16"]
    f.write_text("{not json")
    assert not m.check("budget-16")
    with pytest.raises(MemoryEntryError, match="corrupted"):
        m.get("budget-16")


def test_entries_missing_their_metadata_or_misnamed_are_corrupted(tmp_path):
    """An entry dir without entry.json vanished from list/check (0 of 0 passed), and an
    entry whose id differs from its directory passed check yet could not be shown or reused."""
    m = Memory(tmp_path)
    m.add(entry("a", {"nodes": 8}))
    m.add(entry("b", {"nodes": 9}))
    (tmp_path / "a" / "entry.json").unlink()
    meta = json.loads((tmp_path / "b" / "entry.json").read_text())
    (tmp_path / "b" / "entry.json").write_text(json.dumps(meta | {"id": "other"}))
    assert m.ids() == ["a", "b"]
    with pytest.raises(MemoryEntryError, match="entry.json is missing"):
        m.get("a")
    with pytest.raises(MemoryEntryError, match="differs from its directory name 'b'"):
        m.get("b")
    with pytest.raises(MemoryEntryError, match="no memory entry 'c'"):
        m.get("c")


def test_cycles_and_missing(tmp_path):
    m = Memory(tmp_path)
    m.add(entry("a", {"nodes": 8}, requires=["b"]))
    m.add(entry("b", {"nodes": 9}, requires=["c"]))
    with pytest.raises(MemoryEntryError, match="requires missing entry 'c'"):
        m.apply(STOCK, ["a"])
    m.add(entry("c", {"nodes": 10}, requires=["a"]))
    with pytest.raises(MemoryEntryError, match="cycle: a -> b -> c -> a"):
        m.apply(STOCK, ["a"])
    assert not m.check("a")
    with pytest.raises(MemoryEntryError, match="itself"):
        m.add(entry("d", {}, requires=["d"]))
    m.add(entry("bad", {"nodes": 0}))
    with pytest.raises(MemoryEntryError, match="does not apply"):
        m.apply(STOCK, ["bad"])


# -- code (patch) entries and the ``specpilot memory`` command ------------------------------------

def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def code(tmp_path):
    """A git repo: stock commit, then two approved changes (the second edits a line the first added)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    (repo / "engine.py").write_text("def step():\n    return 1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "stock")
    stock = git(repo, "rev-parse", "HEAD")
    (repo / "engine.py").write_text("def step():\n    return tree()\n")
    git(repo, "commit", "-qam", "tree")
    p1, t1 = git(repo, "diff", "HEAD~1", "HEAD") + "\n", git(repo, "rev-parse", "HEAD^{tree}")
    (repo / "engine.py").write_text("def step():\n    return tree(w12=True)\n")
    git(repo, "commit", "-qam", "w12")
    p2, t2 = git(repo, "diff", "HEAD~1", "HEAD") + "\n", git(repo, "rev-parse", "HEAD^{tree}")
    return repo, stock, (p1, t1), (p2, t2)


def patch_entry(id, patch, stock, tree, requires=()):
    return Entry.model_validate({**entry(id, {}, requires).model_dump(), "kind": "patch", "delta": patch,
                                 "base": {"commit": stock}, "system": {"tree": tree}})


def test_patch_entries_reproduce_and_fail_honestly(code, tmp_path):
    repo, stock, (p1, t1), (p2, t2) = code
    m = Memory(tmp_path / "mem")
    m.add(patch_entry("tree", p1, stock, t1))
    m.add(patch_entry("w12", p2, stock, t2, requires=["tree"]))
    assert (tmp_path / "mem" / "w12" / "delta.patch").read_text() == p2
    assert "delta" not in json.loads((tmp_path / "mem" / "w12" / "entry.json").read_text())
    assert m.get("w12").delta == p2 and m.get("w12").kind == "patch"
    assert [m.reproduce(i, repo).status for i in ("tree", "w12")] == ["reproduced", "reproduced"]
    assert m.apply(STOCK, ["w12"]) == STOCK  # code entries do not change the config
    git(repo, "checkout", "-q", stock)  # the check reads the stock commit, not the work tree
    assert m.reproduce("w12", repo).ok
    # without its requirement the second patch does not apply to stock
    m.add(patch_entry("w12-alone", p2, stock, t2))
    r = m.reproduce("w12-alone", repo)
    assert r.status == "does not apply" and "w12-alone" in r.detail and r.failed
    # a recorded tree that the chain does not rebuild
    m.add(patch_entry("liar", p1, stock, t2))
    r = m.reproduce("liar", repo)
    assert r.status == "differs" and t2[:12] in r.detail
    # a repository without the stock commit: not checkable, said so, not a failure
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    r = m.reproduce("tree", other)
    assert r.status == "not checkable" and stock[:12] in r.detail and not r.failed and not r.ok
    with pytest.raises(ValueError):
        patch_entry("bad", p1, stock, None)


def test_config_entry_on_top_of_a_code_entry(code, tmp_path):
    repo, stock, (p1, t1), _ = code
    m = Memory(tmp_path / "mem")
    m.add(patch_entry("tree", p1, stock, t1))
    big = STOCK.apply({"nodes": 16})
    m.add(entry("budget-16", {"nodes": 16}, requires=["tree"], system=big))
    assert m.reproduce("budget-16", repo).status == "reproduced" and m.apply(STOCK, ["budget-16"]) == big



def test_memory_cli_list_show_check(monkeypatch, capsys, code, tmp_path):
    repo, stock, (p1, t1), (p2, t2) = code
    d = tmp_path / "mem"
    m = Memory(d)
    tree_cfg = STOCK.apply({"tree": "best_first", "top_k": 4})
    m.add(entry("best-first", {"tree": "best_first", "top_k": 4}, system=tree_cfg))
    m.add(patch_entry("tree", p1, stock, t1))
    m.add(patch_entry("w12", p2, stock, t2, requires=["tree"]))
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "list", str(d), "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["id"] for r in rows] == ["best-first", "tree", "w12"]
    assert rows[2]["kind"] == "patch" and rows[2]["requires"] == ["tree"] and rows[0]["gain"] == 1.1
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "list", str(d))
    assert rc == 0 and "best-first" in out and "w12" in out
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "show", str(d), "w12")
    assert rc == 0 and "tree(w12=True)" in out and "requires: [\"tree\"]" in out
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "show", str(d), "best-first", "--json")
    assert rc == 0 and json.loads(out)["delta"] == {"tree": "best_first", "top_k": 4}
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "check", str(d), "--repo", str(repo), "--json")
    assert rc == 0 and {r["id"]: r["status"] for r in json.loads(out)} == dict.fromkeys(["best-first", "tree", "w12"], "reproduced")
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "check", str(d), "--repo", str(repo))
    assert rc == 0 and "3 reproduced, 0 not checkable, 0 failed" in out
    # a broken entry: its required entry is missing
    m.add(entry("budget-16", {"nodes": 16}, requires=["gone"], system=tree_cfg.apply({"nodes": 16})))
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "check", str(d), "--repo", str(repo), "--json")
    res = {r["id"]: r for r in json.loads(out)}
    assert rc == 1 and res["budget-16"]["status"] == "broken"
    assert res["budget-16"]["detail"] == "entry 'budget-16' requires missing entry 'gone'"
    assert res["w12"]["status"] == "reproduced"
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "check", str(d), "--repo", str(repo))
    assert rc == 1 and "requires missing entry 'gone'" in out and "1 failed" in out
    (d / "best-first" / "entry.json").write_text("{ not json")  # a corrupted entry: list shows it and exits 1
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "list", str(d))
    assert rc == 1 and "1 corrupted entry: best-first" in err and "w12" in out
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "list", str(d), "--json")
    assert rc == 1 and "error" in {r["id"]: r for r in json.loads(out)}["best-first"]


@pytest.mark.parametrize("args,needle", [
    (["memory", "list", "NOPE"], "NOPE: not found"),
    (["memory", "show", "MEM", "nope"], "no memory entry 'nope'"),
    (["memory", "show", "MEM", "broken"], "corrupted"),
    (["memory", "check", "REPORT"], "its memory/ directory may"),  # a pilot's report dir, not its memory
    (["memory", "check", "EMPTY"], "nothing to check"),  # 0 of 0 used to pass
    (["memory", "show", "MEM", "../mem/ok"], "'../mem/ok' is not a memory entry id"),  # read outside DIR before
    (["memory", "show", "MEM", ".."], "is not a memory entry id"),
])
def test_memory_cli_errors(monkeypatch, capsys, tmp_path, args, needle):
    m = Memory(tmp_path / "mem")
    m.add(entry("ok", {"nodes": 8}, system=STOCK.apply({"nodes": 8})))
    (tmp_path / "mem" / "broken").mkdir()
    (tmp_path / "mem" / "broken" / "entry.json").write_text("{}")
    (tmp_path / "report" / "memory").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    named = {"MEM": "mem", "REPORT": "report", "EMPTY": "empty", "NOPE": "NOPE"}
    args = [str(tmp_path / named[a]) if a in named else a for a in args]
    rc, out, err = run_cli(monkeypatch, capsys, *args)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_legacy_entry_with_inline_delta_is_read_as_config(tmp_path):
    """Entries written before the one-directory-per-entry layout (delta.json beside entry.json) kept the config
    delta inside entry.json: they are still read, as config entries."""
    tree = STOCK.apply({"tree": "best_first", "top_k": 4})
    d = tmp_path / "mem" / "old"
    d.mkdir(parents=True)
    meta = entry("old", {"tree": "best_first", "top_k": 4}, system=tree).model_dump(mode="json")
    del meta["kind"]
    (d / "entry.json").write_text(json.dumps(meta))
    m = Memory(tmp_path / "mem")
    e = m.get("old")
    assert e.kind == "config" and e.delta == {"tree": "best_first", "top_k": 4}
    assert m.reproduce("old").status == "reproduced"
    (d / "entry.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "delta"}))
    with pytest.raises(MemoryEntryError, match="delta.json is missing"):
        m.get("old")


def test_a_delta_that_does_not_apply_names_its_fields(tmp_path):
    """A bad delta must name its fields (it once said only '1 validation error for SystemConfig')."""
    m = Memory(tmp_path / "memory")
    m.add(entry("bad", {"nodes": -4, "bogus": 1}))
    with pytest.raises(MemoryEntryError, match=r"delta does not apply: nodes: .*greater than or equal to 1; bogus: Extra"):
        m.apply(STOCK, ["bad"])


def test_memory_list_of_nothing_is_an_answer_a_check_of_nothing_is_not(monkeypatch, capsys, tmp_path):
    """``list`` is an inventory: an empty directory answers "no entries" (status 0, as ls); ``check`` is a verdict:
    nothing checked is no pass (status 2); a missing directory is bad input (status 2) for both."""
    (tmp_path / "empty").mkdir()
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "list", str(tmp_path / "empty"))
    assert rc == 0 and out.strip() == f"no entries in {tmp_path / 'empty'}" and err == ""
    rc, out, err = run_cli(monkeypatch, capsys, "memory", "list", str(tmp_path / "empty"), "--json")
    assert rc == 0 and json.loads(out) == []
    rc, _, err = run_cli(monkeypatch, capsys, "memory", "check", str(tmp_path / "empty"))
    assert rc == 2 and "nothing to check" in err
    for cmd in ("list", "check"):
        rc, _, err = run_cli(monkeypatch, capsys, "memory", cmd, str(tmp_path / "nope"))
        assert rc == 2 and err.strip() == f"error: memory directory {tmp_path / 'nope'}: not found"
    rc, out, _ = run_cli(monkeypatch, capsys, "memory", "list", "--help")
    assert "also for a directory without entries" in " ".join(out.replace("│", " ").split())
