"""engine.roofline: the work counted per op, the rows built from times and work, and the peak
micro-kernels on the adapter (positive, f16 at least as fast as f32 is not assumed)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from script_support import load_script

from engine.gpu import KernelTime
from engine.roofline import Peaks, measure_peaks, op_work, print_roofline, roofline, rows_as_json


def test_op_work_counts_the_direct_algorithm():
    assert op_work("linear", {"m": 8, "n": 4, "k": 16}, "f16") == (2 * 8 * 4 * 16, 2 * (8 * 16 + 4 * 16 + 8 * 4))
    flops, nbytes = op_work("conv2d", {"b": 2, "cin": 3, "cout": 5, "h": 8, "w": 6, "k": 3, "stride": 2}, "f32")
    assert flops == 2 * 2 * 5 * 4 * 3 * 3 * 9 and nbytes == 4 * (2 * 3 * 48 + 5 * 3 * 9 + 2 * 5 * 12)
    flops, _ = op_work("attention", {"b": 2, "heads": 8, "tq": 64, "tk": 77, "dh": 40, "causal": 0}, "f16")
    assert flops == 4 * 2 * 8 * 64 * 77 * 40
    assert op_work("transpose", {}, "f16") == (0.0, 0.0)
    # f16-storage (halves in memory, f32 arithmetic: what a phone's browser without shader-f16
    # runs) moves the bytes f16 does; a profiled f16s run used to stop at a KeyError
    assert op_work("linear", {"m": 8, "n": 4, "k": 16}, "f16s") == op_work("linear", {"m": 8, "n": 4, "k": 16}, "f16")


def test_roofline_rows_rates_and_fractions():
    peaks = Peaks(f32_tflops=50.0, f16_tflops=100.0, gbps=2000.0)
    times = {"linear": KernelTime(3, 2.0), "group_norm": KernelTime(2, 0.5), "add": KernelTime(4, 0.25),
             "transpose": KernelTime(1, 0.25)}
    work = {"linear": [3, 40e9, 1e9], "group_norm": [2, 1e8, 4e8]}
    rows = roofline(times, work, peaks, "f16")
    assert [r.family for r in rows] == ["linear", "group_norm", "other"]
    lin = rows[0]
    assert lin.tflops == pytest.approx(20.0) and lin.simt_fraction == pytest.approx(0.2)
    assert lin.gbps == pytest.approx(500.0) and lin.bandwidth_fraction == pytest.approx(0.25)
    assert rows[1].gbps == pytest.approx(800.0)
    assert rows[-1].calls == 5 and rows[-1].ms == pytest.approx(0.5)
    assert roofline(times, work, peaks, "f32")[0].simt_fraction == pytest.approx(0.4)  # f32 models: the f32 peak
    lines = []
    print_roofline({"peaks": asdict(peaks), "dtype": "f16", "rows": rows_as_json(rows)}, lines.append)
    text = "\n".join(lines)
    assert "linear" in text and "20.00" in text and "total" in text


@pytest.mark.gpu
def test_measure_peaks_on_the_adapter(gpu):
    peaks = measure_peaks(gpu, reps=2)
    assert peaks.f32_tflops > 0 and peaks.gbps > 0
    assert (peaks.f16_tflops is not None) == gpu.caps.has_f16
    if peaks.f16_tflops is not None:
        assert peaks.f16_tflops > 0


def _driver_sass():
    return load_script("benchmarks/driver_sass.py")


def test_driver_sass_finds_each_kernels_code_in_a_cache_entry():
    """benchmarks/driver_sass.py: a kernel's code is the run of instruction words (control bits in
    bytes 14-15) that ends in a branch to itself; metadata before it (no control bits) is not."""
    import numpy as np

    ds = _driver_sass()
    rng = np.random.default_rng(7)

    def instructions(n):
        words = rng.integers(0, 256, (n, 16), dtype=np.uint8)
        words[:, 14] = rng.integers(1, 256, n)  # stall/yield bits set
        words[:, 15] = rng.integers(0, 0x20, n)
        return words.tobytes()

    end_word = ds.BRA_SELF + bytes([0, 0, 0x83, 0x03, 0, 0, 0x0F, 0])
    meta = bytes(16 * 20) + b"NVuc" + bytes(4)  # 328 bytes: kernels start at offsets = 8 mod 16
    k1 = instructions(40) + end_word
    k2 = instructions(25) + end_word
    blob = b"hdr" + meta + k1 + bytes(16 * 7) + b"pad" + k2
    ranges = ds.code_ranges(blob)
    assert [blob[s:e] for s, e in ranges] == [k1, k2]


def test_driver_sass_reports_each_loops_instruction_mix():
    ds = _driver_sass()
    sass = """
        /*0000*/                   S2R R6, SR_CTAID.X ;
        /*0010*/                   LDS.64 R0, [R1+0x2100] ;
        /*0020*/                   HFMA2 R136, R1.reuse.H1_H1, R3.reuse, R136 ;
        /*0030*/                   HFMA2.MMA R5, R5, R9.reuse, R7.reuse ;
        /*0040*/                   PRMT R15, R106, 0x5432, R106 ;
        /*0050*/               @P1 BRA 0x10 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70;
    """
    (lp,) = ds.loops(sass)
    assert (lp["from"], lp["to"], lp["instructions"]) == (0x10, 0x50, 5)
    assert lp["mix"] == {"LDS.64": 1, "HFMA2": 1, "HFMA2.MMA": 1, "PRMT": 1, "BRA": 1}
