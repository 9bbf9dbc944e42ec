"""Memory entries on disk (§3.5)."""

import json

import pytest

from specpilot.config import SystemConfig
from specpilot.pilot.memory import Entry, Evidence, Memory, MemoryEntryError

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
