"""Hardware catalogue additions: A100 PCIe (80 and 40 GB), MI250 (per GCD), H20 and L40S.
The names published runs and torch print find the right entry (and the SXM spellings keep
theirs), each entry holds its sourced figures, and the step model's GEMM shape and
efficiency family are the die's."""

from __future__ import annotations

import pytest

from paratrain.cost.hardware import load_hardware, resolve_hardware
from paratrain.systems.gemm import FAMILIES, chip_of, family


@pytest.mark.parametrize("text, key", [
    # A100 PCIe, as papers and torch.cuda.get_device_name() spell it
    ("A100 80GB PCIe", "a100-pcie"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie"),
    ("NVIDIA A100-PCIE-80GB", "a100-pcie"),
    ("A100-PCIe-80GB", "a100-pcie"),
    ("NVIDIA A100 PCIe", "a100-pcie"),  # no memory named: the 80 GB card, as "A100" is
    ("A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("A100 PCIe 40GB", "a100-pcie-40gb"),
    ("A100 40GB PCIe", "a100-pcie-40gb"),
    # the SXM parts keep their entries
    ("A100", "a100"),
    ("A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100 80GB", "a100"),
    ("A100 40GB", "a100-40gb"),
    ("A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA Ampere (A100-class, MFU on 312 TF)", "a100"),
    # MI250 is not MI250X, nor the reverse
    ("MI250", "mi250"),
    ("AMD Instinct MI250", "mi250"),
    ("MI250-GCD", "mi250"),
    ("MI250X", "mi250x"),
    ("AMD MI250X", "mi250x"),
    # H20 is not H200 (nor GH200), nor the reverse
    ("H20", "h20"),
    ("NVIDIA H20", "h20"),
    ("HGX H20", "h20"),
    ("H200", "h200"),
    ("H200-SXM-141GB", "h200"),
    ("GH200", "h200"),
    # L40S
    ("L40S", "l40s"),
    ("NVIDIA L40S", "l40s"),
])
def test_spellings_resolve_to_their_card(text, key):
    assert resolve_hardware(text) == key


def test_l40_is_not_taken_for_l40s():
    """The L40 (181 TF BF16 dense) is another card: refused, not priced as an L40S."""
    with pytest.raises(ValueError, match="not in the hardware catalogue"):
        resolve_hardware("L40")


def test_a100_pcie_figures_and_its_pcie_links():
    """NVIDIA A100 datasheet / product brief: 312 TF BF16 dense on both, 80 GB at
    1,935 GB/s and 40 GB at 1,555 GB/s; PCIe Gen4 x16 is 32 GB/s each way, one link per
    card, so a group's per-rank rate does not grow with its size (unlike a mesh)."""
    p80, p40 = load_hardware("a100-pcie"), load_hardware("a100-pcie-40gb")
    sxm80, sxm40 = load_hardware("a100"), load_hardware("a100-40gb")
    for pcie, sxm in ((p80, sxm80), (p40, sxm40)):
        assert pcie.peak_flops == sxm.peak_flops == 312e12
        assert pcie.hbm_bytes == sxm.hbm_bytes
        assert pcie.peak_flops_fp8 is None  # Ampere: no FP8
        assert pcie.gpus_per_node == 8 and pcie.topology == "switch"
        assert pcie.intra_bw == 32e9 < sxm.intra_bw
        assert {pcie.intra_group_bw(g) for g in (2, 4, 8)} == {32e9}
        assert pcie.link(8) == (pcie.intra_alpha, 32e9)
        assert pcie.link(16) == (pcie.inter_alpha, pcie.inter_bw)
    assert (p80.hbm_bytes, p80.hbm_bw) == (80e9, 1.935e12)
    assert (p40.hbm_bytes, p40.hbm_bw) == (40e9, 1.555e12)
    assert p80.hbm_bw < sxm80.hbm_bw  # 1,935 < 2,039 GB/s


def test_mi250_counts_one_gcd_as_mi250x_does():
    """ROCm's MI250 page: 362.1 TF BF16 and 3.2 TB/s per OAM, two GCDs of 104 CUs each;
    the mi250x entry is per GCD, so this one is too (half of each, 64 GB)."""
    mi, mix = load_hardware("mi250"), load_hardware("mi250x")
    assert mi.peak_flops == pytest.approx(362.1e12 / 2)
    assert mi.hbm_bytes == 128e9 / 2 == mix.hbm_bytes
    assert mi.hbm_bw == pytest.approx(3.2e12 / 2)
    assert mi.peak_flops < mix.peak_flops  # 104 CUs against 110
    assert mi.peak_flops_fp8 is None  # CDNA 2: no FP8
    assert mi.gpus_per_node == mix.gpus_per_node == 8  # four packages, eight GCDs
    assert mi.intra_bw == 25e9 == load_hardware("mi250x").intra_bw  # the same links


def test_h20_figures():
    h20, h100 = load_hardware("h20"), load_hardware("h100")
    assert h20.peak_flops == 148e12 and h20.peak_flops_fp8 == 296e12
    assert h20.hbm_bytes == 96e9 and h20.hbm_bw == 4.0e12
    assert h20.gpus_per_node == 8 and h20.intra_bw == h100.intra_bw == 450e9
    assert h20.topology == "switch"


def test_l40s_figures_dense_not_sparse():
    """The datasheet's 733 TF is BF16 *with sparsity* but FP8 *dense*: peak_flops is the
    dense BF16 362.05 TF, peak_flops_fp8 the dense FP8 733 TF."""
    l40s = load_hardware("l40s")
    assert l40s.peak_flops == 362.05e12 and l40s.peak_flops_fp8 == 733e12
    assert l40s.hbm_bytes == 48e9 and l40s.hbm_bw == 0.864e12
    assert l40s.topology == "switch" and l40s.intra_bw == 32e9  # PCIe Gen4, no NVLink


@pytest.mark.parametrize("key, sms, fam", [
    ("a100-pcie", 108, "a100"), ("a100-pcie-40gb", 108, "a100"),
    ("mi250", 104, "mi250x"), ("h20", 78, "h100"), ("l40s", 142, "l40s"),
    # the existing entries keep theirs
    ("a100", 108, "a100"), ("a100-40gb", 108, "a100"), ("mi250x", 110, "mi250x"),
    ("h200", 132, "h100"), ("h100-pcie", 114, "h100"),
])
def test_gemm_chip_and_family(key, sms, fam):
    name = load_hardware(key).name
    assert chip_of(name).sms == sms
    assert family(name) == fam


def test_tiles_follow_the_die():
    assert chip_of(load_hardware("h20").name).tile_n == chip_of("H100-SXM5-80GB").tile_n == 256
    assert chip_of(load_hardware("l40s").name).tile_n == 128
    assert chip_of(load_hardware("mi250").name).tile_m == chip_of("MI250X-GCD").tile_m


def test_unfitted_families_take_their_makers_fitted_figure():
    """MI250 shares MI250X's (unfitted) family and takes AMD's fitted figure (MI300X's);
    L40S has its own family, which no run of the table fits, and takes the mean of the
    NVIDIA families' fitted GEMM efficiencies (``gemm.maker``). A PCIe A100 and H20 take
    their die's fitted figure."""
    from paratrain.systems.fitting import load_params
    from paratrain.systems.gemm import maker

    p = load_params()
    nvidia = [v for k, v in p.gemm_eff.items() if maker(k) == "nvidia"]
    assert "l40s" in FAMILIES and "l40s" not in p.gemm_eff and len(nvidia) >= 3
    assert p.gemm_for(load_hardware("l40s").name) == pytest.approx(sum(nvidia) / len(nvidia))
    assert p.gemm_for(load_hardware("mi250").name) == p.gemm_eff["mi300x"]
    assert [maker(f) for f in ("mi355x", "gaudi3", "tpu-v7x", "b300", "l40s")] == [
        "amd", "intel", "google", "nvidia", "nvidia"]
    assert p.gemm_for(load_hardware("a100-pcie").name) == p.gemm_eff["a100"]
    assert p.gemm_for(load_hardware("h20").name) == p.gemm_eff["h100"]
