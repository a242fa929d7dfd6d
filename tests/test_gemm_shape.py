"""The GEMM efficiency curve has the shape published GEMM benchmarks show (issue 22, item 4).

NVIDIA's "Matrix Multiplication Background User's Guide" (A100 curves) and the
big-square tables of Stas Bekman's "Maximum Achievable Matmul FLOPS" (ml-engineering)
agree on the qualitative shape of cuBLAS bf16 throughput: it rises with K (a long
reduction amortises each tile's prologue and epilogue), rises with M and N until the
output fills whole waves of tiles, saturates near the big-square figure (8192^3), and a
skinny output that fills less than one wave is rescued by split-K rather than running on
a few SMs. These tests check that curve, not any fitted value.
"""

from __future__ import annotations

import pytest

from paratrain.cost.hardware import load_hardware
from paratrain.systems.gemm import chip_of, gemm_s, k_fixed, split_k

A100, H100, H200 = (load_hardware(n) for n in ("a100", "h100", "h200"))
CEILING = 0.8  # the big-square efficiency the curve is scaled by (gemm_eff)


def eff(M: int, N: int, K: int, hw=A100) -> float:
    """Achieved fraction of peak for one bf16 GEMM at gemm_eff = CEILING, HBM at nominal."""
    return 2.0 * M * N * K / gemm_s(M, N, K, hw, chip_of(hw.name), CEILING, 1.0) \
        / hw.peak_flops


@pytest.mark.parametrize("hw", [A100, H100], ids=["a100", "h100"])
def test_efficiency_rises_with_k_and_saturates_near_the_big_square_figure(hw):
    ks = [256, 512, 1024, 2048, 4096, 8192, 16384]
    curve = [eff(8192, 8192, k, hw) for k in ks]
    assert curve == sorted(curve)  # monotone in K
    assert curve[0] < 0.6 * CEILING  # a 256-deep reduction is mostly prologue / epilogue
    assert curve[-1] > 0.95 * CEILING  # a deep one runs at the big-square figure
    assert eff(8192, 8192, 8192, hw) == pytest.approx(CEILING, rel=0.06)
    # the gain from doubling K shrinks as K grows (diminishing returns, as measured)
    gains = [b / a for a, b in zip(curve[:-1], curve[1:], strict=True)]
    assert gains == sorted(gains, reverse=True)


def test_efficiency_rises_with_m_until_the_output_fills_the_waves():
    ms = [16, 64, 256, 1024, 4096, 16384]
    curve = [eff(m, 8192, 8192) for m in ms]
    assert curve == sorted(curve)
    assert curve[0] < 0.2 * CEILING  # 16 rows: memory-bound, a decode-like GEMV
    assert curve[-1] > 0.9 * CEILING


def test_square_sizes_climb_to_the_ceiling():
    sizes = [512, 1024, 2048, 4096, 8192, 16384]
    curve = [eff(n, n, n) for n in sizes]
    assert curve == sorted(curve)
    assert curve[0] < 0.5 * CEILING and curve[-1] > 0.95 * CEILING


def test_a_skinny_output_is_split_over_k_and_beats_one_partial_wave():
    """A 256 x 256 output is 4 tiles of 128 x 128 on 108 SMs: unsplit, 104 SMs idle;
    cuBLAS splits its 65536-deep reduction so every SM works on a slice, and pays for the
    float32 partial tiles through HBM."""
    chip = chip_of(A100.name)
    kf = k_fixed(chip, A100)
    rate, s = split_k(256, 256, 65536, chip, kf)
    assert s > 1
    unsplit = 256 * 256 / (108 * 128 * 128)  # useful share of one wave without a split
    assert rate > 10 * unsplit
    assert eff(256, 256, 65536) > 5 * CEILING * unsplit
    # a shape that already fills its waves is not split
    assert split_k(8192, 8192, 8192, chip, kf)[1] == 1


def test_the_fixed_cost_is_the_chips_machine_balance_not_a_fitted_number():
    """The epilogue writes each output at the SM's share of HBM bandwidth: more FLOPs per
    byte of HBM (H100 over A100) means a longer K to amortise it; more HBM per FLOP (H200
    over H100, same die) a shorter one."""
    a, h, h2 = (k_fixed(chip_of(hw.name), hw) for hw in (A100, H100, H200))
    assert a < h and h2 < h
    assert eff(8192, 8192, 1024, H200) > eff(8192, 8192, 1024, H100)
    tpu = load_hardware("tpu-v5p")
    assert k_fixed(chip_of(tpu.name), tpu) == 0.0  # the systolic array streams K
