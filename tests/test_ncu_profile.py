"""``probes/ncu_profile.py``: its ncu CSV parser and per-case summary (the GPU part runs on the H200 only), and
the clear refusal where ncu is not installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ncu_profile  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(i, kernel, section, name, unit, value, grid="(96, 4, 1)"):
    return (f'"{i}","7","python3","h","{kernel}","1","7","(128, 1, 1)","{grid}","0","9.0","{section}","{name}",'
            f'"{unit}","{value}"')


def test_parse_details_groups_metrics_by_kernel_and_section():
    text = "\n".join([
        "==PROF== Connected to process 7",
        HEADER,
        row(0, "_w12_mma_kernel", "GPU Speed Of Light Throughput", "Duration", "us", "12.48"),
        row(0, "_w12_mma_kernel", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "71.3"),
        row(0, "_w12_mma_kernel", "Occupancy", "Achieved Occupancy", "%", "22.9"),
        row(0, "_w12_mma_kernel", "Compute Workload Analysis", "Issue Slots Busy", "%", "38.5"),
        row(0, "_w12_mma_kernel", "Scheduler Statistics", "One or More Eligible", "%", "41.2"),
        row(1, "_w12_split_sum_kernel", "GPU Speed Of Light Throughput", "Duration", "ns", "2,304"),
        row(1, "_w12_split_sum_kernel", "Launch Statistics", "Registers Per Thread", "register/thread", "40",
            grid="(96, 1, 1)"),
        "==PROF== Disconnected from process 7",
    ])
    ks = ncu_profile.parse_details(text)
    assert [k["kernel"] for k in ks] == ["_w12_mma_kernel", "_w12_split_sum_kernel"]
    assert ks[0]["metrics"]["Occupancy"]["Achieved Occupancy"] == ["%", 22.9]
    assert ks[1]["metrics"]["GPU Speed Of Light Throughput"]["Duration"] == ["ns", 2304.0]  # thousands comma
    s = ncu_profile.summary(ks)
    assert s["kernels"] == 2 and s["total_us"] == pytest.approx(12.48 + 2.304)
    first = s["per_kernel"][0]
    assert (first["dram_pct"], first["issue_busy_pct"], first["eligible_pct"], first["achieved_occupancy_pct"]) == (
        71.3, 38.5, 41.2, 22.9)
    assert s["per_kernel"][1]["registers"] == 40.0 and s["per_kernel"][1]["dram_pct"] is None


def test_parse_details_without_a_header_raises():
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu_profile.parse_details("==ERROR== the profiler could not start\n")


@pytest.mark.skipif(shutil.which("ncu") is not None or Path("/usr/local/cuda/bin/ncu").exists(),
                    reason="ncu is installed here")
def test_without_ncu_the_script_says_so(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_profile.py"), str(tmp_path / "o.json"),
                        "--cases", "w12-o-1"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and "ncu (Nsight Compute) is not installed" in p.stderr
    assert not (tmp_path / "o.json").exists()


def test_run_case_refuses_in_one_line():
    """The internal ``--run-case`` child: an unknown case, or no CUDA, is one line and exit 1, not a traceback."""
    cmd = [sys.executable, str(ROOT / "bench" / "ncu_profile.py"), "--run-case"]
    bad = subprocess.run(cmd + ["nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr.strip() == "ncu_profile: unknown case 'nope'"
    import torch

    if torch.cuda.is_available():
        return
    p = subprocess.run(cmd + ["w12-qkv-1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.strip() == "ncu_profile: --run-case needs a CUDA GPU"


def test_parse_of_a_bad_file_is_one_line(tmp_path):
    bad = tmp_path / "g.csv"
    bad.write_text("garbage\n")
    for path in (bad, tmp_path / "missing.csv"):
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_profile.py"), "--parse", str(path)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.startswith("error: cannot parse") and "Traceback" not in p.stderr
