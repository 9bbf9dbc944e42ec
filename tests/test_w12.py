"""W12 (§4.1): bit-exact round trips, the record layout, pack / verify / load, corrupted and truncated files."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from specpilot.w12.format import (NIBBLE_BYTES, RECORD_BYTES, VIEW_BYTES, W12FormatError, approx_view, decode,
                                  encode)
from specpilot.w12.pack import is_linear_weight, pack_dir
from specpilot.w12.verify import load_w12_state_dict, verify_dir
from specpilot.zoo import bundled_drafter_dir, bundled_target_dir

from .conftest import save_tiny, run_cli


def bits(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16)


def from_bits(pattern: int) -> torch.Tensor:
    """A 0-d bf16 with the 16-bit pattern ``pattern`` (0..65535)."""
    return torch.tensor([pattern - 65536 if pattern >= 32768 else pattern], dtype=torch.int16).view(torch.bfloat16)[0]


SPECIAL = {  # name -> bf16 bit pattern
    "+0": 0x0000, "-0": 0x8000, "denorm_min": 0x0001, "-denorm": 0x807F, "denorm_mid": 0x0040,
    "+inf": 0x7F80, "-inf": 0xFF80, "nan": 0x7FC0, "nan_payload": 0x7F81, "-nan_payload": 0xFFFF,
    "nan_quiet_payload": 0x7FD5, "max": 0x7F7F, "-max": 0xFF7F, "tiny_normal": 0x0080, "huge": 0x7100,
    "tiny": 0x0D00,
}


def planted(n=300, k=200, seed=0):
    """Random bf16 [n, k] (std 0.02) with every SPECIAL pattern planted at known positions; returns (w, positions)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    pos = {}
    for i, (name, p) in enumerate(SPECIAL.items()):
        r, c = (37 * i + 5) % n, (53 * i + 11) % k
        w[r, c] = from_bits(p)
        pos[name] = r * k + c
    return w, pos


def test_roundtrip_planted_specials_bit_exact():
    w, pos = planted()
    t = encode(w)
    assert t.records.shape == (3, 4, RECORD_BYTES) and t.base.shape == (300,)
    out = decode(t)
    assert out.dtype == torch.bfloat16 and torch.equal(bits(out), bits(w))
    esc = set(t.esc_idx.tolist())
    for name in SPECIAL:  # every special is outside any window of normals around 0.02
        assert pos[name] in esc, name
    assert t.esc_idx.dtype == torch.int32 and bool((t.esc_idx[1:] > t.esc_idx[:-1]).all())
    assert t.num_escapes < len(SPECIAL) + 30  # the gaussian bulk itself is not escaped
    assert torch.equal(t.esc_val, bits(w).reshape(-1)[t.esc_idx.long()])


def test_roundtrip_random_bit_patterns():
    """Every 16-bit pattern is possible: all exponents, NaN payloads, signs."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(-32768, 32768, (257, 130), generator=g, dtype=torch.int32).to(torch.int16)
    w = raw.view(torch.bfloat16)
    t = encode(w)
    assert torch.equal(bits(decode(t)), raw)
    assert 0.5 < t.escape_rate < 1.0  # 16 of ~254 binades fit a window


@pytest.mark.parametrize("shape", [(1, 1), (1, 64), (128, 64), (129, 65), (5, 1000), (1000, 3)])
def test_roundtrip_shapes(shape):
    w = (torch.randn(*shape) * 3).to(torch.bfloat16)
    w.view(-1)[0] = -0.0
    t = encode(w)
    assert torch.equal(bits(decode(t)), bits(w))
    nt, kt = -(-shape[0] // 128), -(-shape[1] // 64)
    assert t.records.shape == (nt, kt, RECORD_BYTES)
    assert t.nbytes == nt * kt * RECORD_BYTES + shape[0] + 6 * t.num_escapes


def test_window_choice_and_escapes():
    """Row 0: ten 1.0 (e=127), five 2^-10 (e=117), one 2^-20 (e=107): best window [112, 127] (lowest start)."""
    w = torch.full((2, 64), 0.5, dtype=torch.bfloat16)
    w[0, :10], w[0, 10:15], w[0, 15] = 1.0, 2.0**-10, 2.0**-20
    w[0, 16:] = 1.5
    w[1, :] = 2.0**-3  # e = 124: a one-binade row; the lowest window holding it starts at 109
    t = encode(w)
    assert t.base.tolist() == [112, 109]
    assert t.esc_idx.tolist() == [15]
    assert torch.equal(bits(decode(t)), bits(w))


def _expected_view_nibble(pattern: int, base: int) -> tuple[int, int]:
    """Scalar reference of the 12-bit code split (in-window weights only)."""
    s, e, m = pattern >> 15, (pattern >> 7) & 0xFF, pattern & 0x7F
    assert base <= e <= base + 15
    return (s << 7) | ((e - base) << 3) | (m >> 4), m & 15


def test_record_layout():
    """Record (t, j) holds rows 128t.. and columns 64j.., views row-major, then nibbles two per byte."""
    w, _ = planted(300, 200, seed=3)
    t = encode(w)
    esc = set(t.esc_idx.tolist())
    u16 = (bits(w).to(torch.int32) & 0xFFFF).tolist()
    base = t.base.tolist()
    rec = t.records[1, 2]  # rows 128..255, columns 128..191
    checked = 0
    for r, c in [(0, 0), (0, 1), (5, 63), (127, 62), (127, 63), (64, 31), (100, 10)]:
        n, k = 128 + r, 128 + c
        if n * 200 + k in esc:
            continue
        view, nib = _expected_view_nibble(u16[n][k], base[n])
        assert int(rec[64 * r + c]) == view
        byte = int(rec[VIEW_BYTES + 32 * r + c // 2])
        assert (byte >> 4 if c % 2 else byte & 15) == nib
        checked += 1
    assert checked >= 6
    # the last record band/column block is padded with code 0: rows 300.. and columns 200.. are zero
    last = t.records[2, 3]  # rows 256..383 (44 real), columns 192..255 (8 real)
    views = last[:VIEW_BYTES].view(128, 64)
    nibs = last[VIEW_BYTES:].view(128, 32)
    assert bool((views[44:] == 0).all()) and bool((views[:, 8:] == 0).all())
    assert bool((nibs[44:] == 0).all()) and bool((nibs[:, 4:] == 0).all())
    assert bool((views[:44, :8] != 0).any())
    assert NIBBLE_BYTES == 4096 and VIEW_BYTES == 8192


def test_record_layout_rewrite_roundtrip():
    """Writing one weight's code into its record bytes by the documented layout changes exactly that weight."""
    w = (torch.randn(256, 128) * 0.05).to(torch.bfloat16)
    t = encode(w)
    n, k = 200, 77  # record (1, 1), r = 72, c = 13
    target = w[n, k].abs() * 1.0078125 if w[n, k] != 0 else torch.tensor(0.05, dtype=torch.bfloat16)
    new = target.to(torch.bfloat16)
    view, nib = _expected_view_nibble(int(bits(new.reshape(1))[0]) & 0xFFFF, int(t.base[n]))
    rec = t.records[1, 1]
    rec[64 * 72 + 13] = view
    b = int(rec[VIEW_BYTES + 32 * 72 + 6])
    rec[VIEW_BYTES + 32 * 72 + 6] = (b & 0x0F) | (nib << 4)  # column 13 is odd: high nibble
    t.esc_idx = t.esc_idx[t.esc_idx != n * 128 + k]
    t.esc_val = bits(w).reshape(-1)[t.esc_idx.long()]
    out = decode(t, check=False)
    changed = (bits(out) != bits(w)).nonzero().tolist()
    assert changed == [[n, k]] and out[n, k] == new


def test_approx_view_midpoint_and_escapes():
    w, pos = planted(256, 128, seed=4)
    t = encode(w)
    a = approx_view(t)
    wb, ab = bits(w).to(torch.int32) & 0xFFFF, bits(a).to(torch.int32) & 0xFFFF
    esc = torch.zeros(w.numel(), dtype=torch.bool)
    esc[t.esc_idx.long()] = True
    esc = esc.view_as(w)
    assert torch.equal(ab[esc], wb[esc])  # escapes exact (incl. NaN payloads)
    keep = ~esc
    assert torch.equal(ab[keep] >> 4, wb[keep] >> 4)  # sign, exponent, top 3 mantissa bits kept
    assert bool((ab[keep] & 15 == 8).all())  # dropped bits at their midpoint
    rel = ((a.float() - w.float()).abs() / w.float().abs())[keep]
    assert rel.max() <= 2.0**-4 and rel.mean() < 2.0**-5


def test_non_bf16_refused():
    for dt in (torch.float32, torch.float16):
        with pytest.raises(W12FormatError, match="bfloat16"):
            encode(torch.randn(4, 4, dtype=dt))
    with pytest.raises(W12FormatError, match="2-D"):
        encode(torch.randn(2, 3, 4).to(torch.bfloat16))


def test_decode_detects_corruption():
    w = (torch.randn(128, 64) * 0.02).to(torch.bfloat16)
    t = encode(w)
    t.records[0, 0, 100] ^= 0x10
    with pytest.raises(W12FormatError, match="sha256"):
        decode(t)
    t2 = encode(w)
    t2.base = t2.base[:-1]
    with pytest.raises(W12FormatError, match="base"):
        decode(t2)


def _linear_weights(d):
    sd = load_file(str(d / "model.safetensors"))
    return {k: v for k, v in sd.items() if is_linear_weight(k, v, tied=True)}


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_bundled_weights_roundtrip(which):
    d = bundled_target_dir() if which == "target" else bundled_drafter_dir()
    ws = _linear_weights(d)
    assert len(ws) == (42 if which == "target" else 7 * len({k.split(".")[2] for k in ws}))
    esc = n = 0
    for name, w in ws.items():
        t = encode(w)
        assert torch.equal(bits(decode(t)), bits(w)), name
        esc, n = esc + t.num_escapes, n + t.num_weights
    assert esc / n < 1e-4  # the goal (measured 5.3e-5 target, 4.6e-5 drafter)



@pytest.fixture(scope="module")
def packed_target(tmp_path_factory):
    out = tmp_path_factory.mktemp("w12") / "target"
    pack_dir(bundled_target_dir(), out)
    return out


def test_cli_pack_verify_bundled_target(monkeypatch, capsys, tmp_path):
    src, out = bundled_target_dir(), tmp_path / "t12"
    code, so, err = run_cli(monkeypatch, capsys, "w12", "pack", str(src), str(out))
    assert code == 0, err
    assert "42 tensors W12" in so
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(out), "--json", "--source", str(src))
    assert code == 0, err
    rep = json.loads(so)
    assert rep["bit_exact"] is True and rep["source_checked"] and rep["unconverted_match_source"]
    assert rep["tensors_w12"] == 42 and rep["tensors_raw"] == 0 and len(rep["tensors"]) == 42
    # measured: 12.0065 bits/weight (window bases in 1-2 bits a row; one byte a row, format 1, was 12.0286 at
    # K = 256), escape rate 5.3e-5: the "at most 12.02 bits/weight, escapes under 1e-4"
    assert 12.0 < rep["bits_per_weight"] <= 12.02
    assert rep["escape_rate"] < 1e-4
    assert all(r["bit_exact"] and r["error"] is None for r in rep["tensors"])
    for f in src.iterdir():  # everything but the weights is copied unchanged
        if f.suffix != ".safetensors":
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    man = json.loads((out / "w12.json").read_text())
    assert man["version"] == 2 and man["record"]["bytes"] == 12288
    assert man["totals"]["bits_per_weight"] == pytest.approx(rep["bits_per_weight"])
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(out))
    assert code == 0 and "total" in so and "12.006" in so
    assert "no --source given" in so  # bit-exact against the stored hashes, said so


def test_cli_pack_into_or_around_its_own_source_is_refused(monkeypatch, capsys, tmp_path):
    """Fresh-user run 16: ``w12 pack SRC SRC/inner`` exited 0 with a raw copy of the source inside the output."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(bundled_target_dir(), src)
    before = sorted(p.name for p in src.iterdir())
    code, _, err = run_cli(monkeypatch, capsys, "w12", "pack", str(src), str(src / "inner"))
    assert code == 2 and "must not contain one another" in err and "Traceback" not in err, err
    code, _, err = run_cli(monkeypatch, capsys, "w12", "pack", str(src), str(src / "inner" / ".."))
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1, err  # the source itself: not empty
    assert sorted(p.name for p in src.iterdir()) == before  # nothing written into the source


def test_load_w12_state_dict_bit_exact(packed_target):
    src = load_file(str(bundled_target_dir() / "model.safetensors"))
    got = load_w12_state_dict(packed_target)
    assert set(got) == set(src)
    for k in src:
        assert got[k].dtype == src[k].dtype and torch.equal(bits(got[k]), bits(src[k])), k


def _tensor_offsets(path, key):
    """Absolute byte range of tensor ``key``'s data in a safetensors file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    start, end = json.loads(raw[8:8 + n])[key]["data_offsets"]
    return 8 + n + start, 8 + n + end


def test_corrupted_records_not_bit_exact(monkeypatch, capsys, tmp_path, packed_target):
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(packed_target, d)
    f = d / "model.safetensors"
    key = "model.layers.2.mlp.up_proj.weight"
    a, b = _tensor_offsets(f, key + ".w12.records")
    raw = bytearray(f.read_bytes())
    for off in (a + 17, a + 9000, b - 5):
        raw[off] ^= 0x5A
    f.write_bytes(bytes(raw))
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(d), "--json")
    assert code == 1
    rep = json.loads(so)
    assert rep["bit_exact"] is False
    bad = [r for r in rep["tensors"] if not r["bit_exact"]]
    assert [r["name"] for r in bad] == [key] and "sha256" in bad[0]["error"]
    with pytest.raises(W12FormatError, match="sha256"):
        load_w12_state_dict(d)


def test_corrupted_escape_index_not_bit_exact(tmp_path, packed_target):
    import shutil

    d = tmp_path / "bad"
    shutil.copytree(packed_target, d)
    f = d / "model.safetensors"
    key = "model.layers.0.mlp.down_proj.weight"
    a, _ = _tensor_offsets(f, key + ".w12.esc_idx")
    raw = bytearray(f.read_bytes())
    raw[a + 3] ^= 0x40  # the first escape position becomes huge
    f.write_bytes(bytes(raw))
    rep = verify_dir(d)
    bad = [r for r in rep["tensors"] if not r["bit_exact"]]
    assert [r["name"] for r in bad] == [key] and "escape" in bad[0]["error"]


@pytest.mark.parametrize("entry", [None, {"shape": "abc"}, {"encoding": "zzz"}, {"sha256": 5}, {"shape": [4, True]},
                                   {"dtype": "junk"}, {"dtype": 3}])
def test_malformed_manifest_entry_one_line_error(monkeypatch, capsys, tmp_path, packed_target, entry):
    """A tensor entry of w12.json that is null or has a field of the wrong type or value: one clear error from
    verify and from the loader (fresh-user run 26 saw AttributeError / TypeError tracebacks)."""
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(packed_target, d)
    m = json.loads((d / "w12.json").read_text())
    key = "model.layers.0.mlp.down_proj.weight"
    m["tensors"][key] = None if entry is None else {**m["tensors"][key], **entry}
    (d / "w12.json").write_text(json.dumps(m))
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(d))
    assert code == 2 and so == "" and err.count("\n") == 1
    assert err.startswith("error: ") and f"bad entry for {key!r}" in err
    with pytest.raises(W12FormatError, match="bad entry"):
        load_w12_state_dict(d)


@pytest.mark.parametrize("cut", ["data", "header"])
def test_truncated_file_one_line_error(monkeypatch, capsys, tmp_path, packed_target, cut):
    import shutil

    d = tmp_path / "trunc"
    shutil.copytree(packed_target, d)
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) - 1000] if cut == "data" else raw[:100])
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(d), "--json")
    assert code == 2 and json.loads(so) == {"directory": str(d), "bit_exact": False,
                                           "error": err.strip().removeprefix("error: ")}
    assert err.startswith("error: cannot read model.safetensors: corrupted or truncated") and err.count("\n") == 1
    with pytest.raises(W12FormatError, match="truncated"):
        load_w12_state_dict(d)


def test_cli_errors(monkeypatch, capsys, tmp_path, packed_target):
    code, _, err = run_cli(monkeypatch, capsys, "w12", "verify", str(tmp_path))
    assert code == 2 and "no w12.json" in err
    code, _, err = run_cli(monkeypatch, capsys, "w12", "pack", str(bundled_target_dir()), str(packed_target))
    assert code == 2 and "not empty" in err
    code, _, err = run_cli(monkeypatch, capsys, "w12", "pack", str(tmp_path / "nope"), str(tmp_path / "o"))
    assert code == 2 and "not found" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(monkeypatch, capsys, "w12", "pack", str(tmp_path / "empty"), str(tmp_path / "o2"))
    assert code == 2 and "no *.safetensors" in err
    code, _, err = run_cli(monkeypatch, capsys, "w12", "pack", str(packed_target), str(tmp_path / "o3"))
    assert code == 2 and "already a W12" in err


def test_non_bf16_checkpoint_stored_raw(monkeypatch, capsys, tmp_path):
    """A float32 checkpoint: linear weights are kept as they are and reported raw at 32 bits/weight."""
    src = save_tiny(tmp_path / "f32", hidden=64, layers=1)
    out = tmp_path / "out"
    code, so, err = run_cli(monkeypatch, capsys, "w12", "pack", src, str(out))
    assert code == 0, err
    assert "0 tensors W12, 8 kept raw" in so  # 7 per layer + the untied lm_head
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(out), "--json", "--source", src)
    assert code == 0, err
    rep = json.loads(so)
    assert rep["bit_exact"] and rep["tensors_raw"] == 8 and rep["bits_per_weight"] == 32.0
    assert {r["encoding"] for r in rep["tensors"]} == {"raw"} and {r["dtype"] for r in rep["tensors"]} == {"float32"}
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(out))
    assert code == 0 and "raw (float32)" in so


def test_sharded_mixed_dtypes_untied_head(tmp_path):
    """Two shards + index, an untied lm_head (converted), a float16 linear weight (raw), norms and embeddings kept."""
    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(5)

    def r(*s, dt=torch.bfloat16):
        return (torch.randn(*s, generator=g) * 0.03).to(dt)

    s1 = {"model.embed_tokens.weight": r(50, 64), "model.layers.0.mlp.up_proj.weight": r(96, 64),
          "model.layers.0.input_layernorm.weight": r(64)}
    s2 = {"lm_head.weight": r(50, 64), "model.layers.0.self_attn.o_proj.weight": r(64, 64, dt=torch.float16),
          "model.layers.0.mlp.down_proj.bias": r(64), "model.norm.weight": r(64)}
    save_file(s1, str(src / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(s2, str(src / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    wm = {k: "model-00001-of-00002.safetensors" for k in s1} | {k: "model-00002-of-00002.safetensors" for k in s2}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}))
    (src / "config.json").write_text(json.dumps({"model_type": "mystery", "tie_word_embeddings": False}))
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("hello")
    out = tmp_path / "out"
    man = pack_dir(src, out)
    enc = {k: e["encoding"] for k, e in man["tensors"].items()}
    assert enc == {"model.layers.0.mlp.up_proj.weight": "w12", "lm_head.weight": "w12",
                   "model.layers.0.self_attn.o_proj.weight": "raw"}
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in idx["weight_map"]
    assert idx["weight_map"]["lm_head.weight.w12.records"] == "model-00002-of-00002.safetensors"
    assert idx["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for f in out.glob("*.safetensors") for v in load_file(str(f)).values())
    assert (out / "sub" / "notes.txt").read_text() == "hello"
    rep = verify_dir(out, source=src)
    assert rep["bit_exact"] and rep["unconverted_match_source"] and rep["tensors_w12"] == 2
    state = load_w12_state_dict(out)
    for k, v in (s1 | s2).items():
        assert state[k].dtype == v.dtype and torch.equal(state[k].view(torch.uint8), v.view(torch.uint8)), k
    # with the head tied it is an embedding alias and stays as it is
    assert not is_linear_weight("lm_head.weight", s2["lm_head.weight"], tied=True)
    assert is_linear_weight("lm_head.weight", s2["lm_head.weight"], tied=False)


def test_verify_source_mismatch(tmp_path, packed_target):
    """--source catches a source that differs from what was packed (here: another checkpoint)."""
    rep = verify_dir(packed_target, source=bundled_drafter_dir())
    assert rep["bit_exact"] is False and not rep["unconverted_match_source"]
    assert all(not r["bit_exact"] for r in rep["tensors"])


def _flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_flipped_copied_tensor_is_caught_and_named(monkeypatch, capsys, tmp_path, packed_target):
    """Fresh-user finding: a flipped byte in a tensor copied unchanged (the embedding) passed as bit-exact."""
    import shutil

    from specpilot.model.checkpoint import load_model

    d = tmp_path / "bad"
    shutil.copytree(packed_target, d)
    key = "model.embed_tokens.weight"
    assert key in json.loads((d / "w12.json").read_text())["copied_tensors"]
    a, _ = _tensor_offsets(d / "model.safetensors", key)
    _flip(d / "model.safetensors", a + 1234)
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(d), "--json")
    assert code == 1, err
    rep = json.loads(so)
    assert rep["bit_exact"] is False and all(r["bit_exact"] for r in rep["tensors"])
    assert [r["name"] for r in rep["copied_tensors"] if not r["bit_exact"]] == [key]
    assert any(key in p and "sha256" in p for p in rep["problems"])
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(d))
    assert code == 1 and key in so
    with pytest.raises(W12FormatError, match="embed_tokens"):
        load_model(d)


@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json"])
def test_flipped_copied_file_is_caught_and_named(monkeypatch, capsys, tmp_path, packed_target, name):
    import shutil

    from specpilot.model.checkpoint import load_model

    d = tmp_path / "bad"
    shutil.copytree(packed_target, d)
    man = json.loads((d / "w12.json").read_text())
    assert set(man["files"]) >= {"config.json", "tokenizer.json", "generation_config.json"}
    raw = (d / name).read_bytes()
    (d / name).write_bytes(raw.replace(b"1", b"2", 1))
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(d), "--json")
    assert code == 1, err
    rep = json.loads(so)
    assert [r["path"] for r in rep["files"] if not r["ok"]] == [name]
    assert any(p.startswith(f"copied file {name}") for p in rep["problems"])
    with pytest.raises(W12FormatError, match=name.replace(".", r"\.")):
        load_model(d)
    (d / name).unlink()
    assert "missing" in " ".join(verify_dir(d)["problems"])


def test_old_manifest_without_file_hashes_says_what_it_could_not_check(monkeypatch, capsys, tmp_path, packed_target):
    import shutil

    d = tmp_path / "old"
    shutil.copytree(packed_target, d)
    man = json.loads((d / "w12.json").read_text())
    del man["files"], man["copied_tensors"]
    (d / "w12.json").write_text(json.dumps(man))
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(d), "--json")
    assert code == 0, err
    rep = json.loads(so)
    assert rep["bit_exact"] and len(rep["not_checked"]) == 2 and rep["files"] == [] and rep["copied_tensors"] == []
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(d))
    assert code == 0 and so.count("not checked:") == 2 and "predates" in so
    with pytest.warns(UserWarning, match="not checked"):
        state = load_w12_state_dict(d)
    assert "model.embed_tokens.weight" in state


def test_packed_files_respect_umask(tmp_path, packed_target):
    """Fresh-user finding: model.safetensors was written 0600 (safetensors' own mode) whatever the umask."""
    import os

    from specpilot.fileio import current_umask

    want = 0o666 & ~current_umask()
    for f in packed_target.iterdir():
        if f.suffix in (".safetensors", ".json"):
            assert os.stat(f).st_mode & 0o777 == want, f.name


def test_verify_source_mismatch_names_tensors(monkeypatch, capsys, tmp_path, packed_target):
    """--source: the report names the first mismatching tensors and counts them."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(bundled_target_dir(), src)
    sd = load_file(str(src / "model.safetensors"))
    key = "model.norm.weight"
    sd[key] = sd[key].clone()
    sd[key].view(torch.int16)[0] ^= 1
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    rep = verify_dir(packed_target, source=src)
    assert rep["bit_exact"] is False and rep["source_mismatches"] == [{"name": key, "reason": "differs from the source"}]
    code, so, err = run_cli(monkeypatch, capsys, "w12", "verify", str(packed_target), "--source", str(src))
    assert code == 1 and f"1 tensor(s) differ from --source, first: {key}" in so.replace("\n", " ")


@pytest.mark.parametrize("n,lo,hi", [(0, 1, 1), (1, 9, 9), (7, 100, 103), (256, 110, 111), (300, 1, 239), (129, 50, 57)])
def test_window_bases_pack_round_trip(n, lo, hi):
    """Format 2 stores the rows' window bases as ``b0``, a width and ``n`` deltas of that many bits."""
    from specpilot.w12.format import pack_bases, unpack_bases

    base = torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(n)).to(torch.uint8)
    blob = pack_bases(base)
    w = int(base.max() - base.min()).bit_length() if n else 0
    assert blob.dtype == torch.uint8 and blob.numel() == 2 + -(-n * w // 8) and int(blob[1]) == w
    assert torch.equal(unpack_bases(blob, n), base)


def test_window_bases_malformed_blobs_are_clear_errors():
    from specpilot.w12.format import pack_bases, unpack_bases

    blob = pack_bases(torch.tensor([10, 11, 13, 10], dtype=torch.uint8))
    for bad, n in ((blob[:-1], 4), (blob, 5), (torch.tensor([1, 9, 0], dtype=torch.uint8), 1),
                   (blob.to(torch.int16), 4), (torch.tensor([250, 3, 255], dtype=torch.uint8), 2)):
        with pytest.raises(W12FormatError, match="window bases"):
            unpack_bases(bad, n)


def test_format_1_directories_still_load_and_verify(packed_target, tmp_path):
    """A directory written by format 1 (one window byte a row, ``NAME.w12.base``) loads and verifies."""
    from specpilot.fileio import save_safetensors
    from specpilot.w12.format import unpack_bases

    old = tmp_path / "v1"
    shutil.copytree(packed_target, old)
    man = json.loads((old / "w12.json").read_text())
    tensors = load_file(str(old / "model.safetensors"))
    for name, e in man["tensors"].items():
        blob = tensors.pop(f"{name}.w12.bases")
        base = unpack_bases(blob, e["shape"][0])
        tensors[f"{name}.w12.base"] = base
        e["bytes"] += base.numel() - blob.numel()
    save_safetensors(tensors, old / "model.safetensors")
    man["version"] = 1
    (old / "w12.json").write_text(json.dumps(man))
    rep = verify_dir(old)
    assert rep["bit_exact"] and 12.02 < rep["bits_per_weight"] < 12.04  # one byte a row: 12.0286
    src = load_file(str(bundled_target_dir() / "model.safetensors"))
    got = load_w12_state_dict(old)
    assert all(torch.equal(bits(got[k]), bits(src[k])) for k in src)


@pytest.mark.parametrize("out_exists", [False, True])
def test_failed_pack_leaves_nothing_so_the_retry_runs(monkeypatch, capsys, tmp_path, out_exists):
    """Fresh-user run 26: a source with a garbage safetensors file failed cleanly but left the good files in
    the output directory, so the retry was refused as "not empty". Now the output is as it was before."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(bundled_target_dir(), src)
    (src / "z.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    out = tmp_path / "out"
    if out_exists:
        out.mkdir()
    code, _, err = run_cli(monkeypatch, capsys, "w12", "pack", str(src), str(out))
    assert code == 2 and err.startswith("error: cannot read z.safetensors") and err.count("\n") == 1
    assert (out.is_dir() and not any(out.iterdir())) if out_exists else not out.exists()
    (src / "z.safetensors").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "w12", "pack", str(src), str(out))
    assert code == 0, err
