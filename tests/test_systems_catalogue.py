"""Catalogues: every entry loads, counts derive from shape, user files, clear errors,
and importing the systems model does not import torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from paratrain.cost import collectives as coll
from paratrain.cost.hardware import Hardware, hardware_names, load_hardware, resolve_hardware
from paratrain.cost.shapes import load_model, model_names

REQUIRED_HW = ["v100", "a100-40gb", "a100", "a800", "h100", "h100-pcie", "h100-nvl",
               "h100-96gb", "h200", "b200", "gb200", "b300", "gb300", "mi300x", "mi325x", "mi355x",
               "gaudi2", "gaudi3", "tpu-v4", "tpu-v5p", "tpu-v6e", "tpu-v7x"]


def test_importing_systems_does_not_import_torch():
    code = ("import importlib, pkgutil, sys, paratrain.systems as s, paratrain.viz.plan_plots\n"
            "for m in pkgutil.iter_modules(s.__path__): importlib.import_module(s.__name__ + "
            "'.' + m.name)\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", REQUIRED_HW)
def test_required_hardware(name):
    hw = load_hardware(name)
    assert hw.peak_flops > 0 and hw.hbm_bytes > 0
    assert hw.topology == ("torus" if name.startswith("tpu")
                           else "mesh" if name.startswith(("mi3", "gaudi")) else "switch")


def test_a_mesh_node_gives_a_group_one_link_per_peer():
    """MI300X's eight GPUs are fully connected by 64 GB/s Infinity Fabric links, no switch:
    a pair moves over one link, a group of four over three, all eight over seven (RCCL's
    rings over a full mesh run on disjoint links), and the systems model's collectives
    read that (:func:`paratrain.systems.comm_time.strided_bw`). An NVSwitch node gives any
    group its whole NVLink bandwidth. Across nodes the NIC is the limit either way."""
    from paratrain.systems.comm_time import strided_bw

    mi, h = load_hardware("mi300x"), load_hardware("h100")
    assert mi.intra_bw == 64e9
    assert [mi.intra_group_bw(g) for g in (1, 2, 4, 8, 16)] == [64e9, 64e9, 192e9, 448e9,
                                                                448e9]
    assert {h.intra_group_bw(g) for g in (2, 4, 8)} == {h.intra_bw}
    assert mi.link(8) == (mi.intra_alpha, 448e9) and mi.link(7, 4) == (mi.intra_alpha, 192e9)
    assert mi.link(16) == (mi.inter_alpha, mi.inter_bw)
    assert strided_bw(1, 8, mi, 0.5, 1.0) == (mi.intra_alpha, 224e9)
    assert strided_bw(2, 2, mi, 0.5, 1.0) == (mi.intra_alpha, 32e9)
    # two nodes of eight: the ring crosses on eight NICs (8 x 50 GB/s) but never moves
    # more than a rank's seven links carry; at half the NICs' rate those are the limit
    assert strided_bw(1, 16, mi, 0.5, 1.0) == (mi.inter_alpha, 224e9)
    assert strided_bw(1, 16, mi, 0.5, 0.5) == (mi.inter_alpha, 200e9)


def test_every_hardware_entry_loads_and_aliases_are_case_insensitive():
    for n in hardware_names():
        assert isinstance(load_hardware(n), Hardware)
    assert load_hardware("H100") == load_hardware("h100-sxm5") == load_hardware("H100-SXM5-80GB")
    assert load_hardware("h100").peak_flops_fp8 == 1979e12


def test_every_hardware_entry_names_its_source():
    """Each catalogue table opens with a comment block that names where its figures come
    from (issue 22, item 7)."""
    from paratrain.cost.catalogue import DATA_DIR

    blocks = (DATA_DIR / "hardware.toml").read_text(encoding="utf-8").split("\n[")[1:]
    assert len(blocks) == len(hardware_names())
    for block in blocks:
        key, _, rest = block.partition("]")
        comment = " ".join(ln for ln in rest.splitlines() if ln.startswith("#"))
        assert "Source" in comment, f"hardware entry {key!r} names no source"


def test_h100_variants_blackwell_domains_and_tpu_v5p():
    from paratrain.systems.gemm import chip_of, family

    pcie, nvl, sxm = load_hardware("H100 PCIe"), load_hardware("h100-nvl"), load_hardware("h100")
    assert pcie.peak_flops < nvl.peak_flops < sxm.peak_flops  # 756 < 835 < 989 TF dense
    assert nvl.hbm_bytes == 94e9 and nvl.hbm_bw > sxm.hbm_bw  # 94 GB HBM3 at 3.9 TB/s
    assert chip_of(pcie.name).sms == 114 and chip_of(nvl.name).sms == 132
    assert family(pcie.name) == family(nvl.name) == "h100"  # one die's fitted efficiencies
    # the lower-TDP 94/95/96 GB HBM2e part under the names clusters list it by
    assert load_hardware("h100-95gb") == load_hardware("H100-SXM5-94GB") == \
        load_hardware("h100-96gb")
    assert load_hardware("gb200").gpus_per_node == 72  # NVL72: one NVLink domain
    assert load_hardware("b200").gpus_per_node == 8
    assert load_hardware("gb300").gpus_per_node == 72 and load_hardware("b300").gpus_per_node == 8
    v5p = load_hardware("tpu-v5p")
    assert v5p.topology == "torus" and v5p.hbm_bytes == 96e9


def test_tpu_v3_and_one_mi250x_die_are_named_as_papers_name_them():
    """TPU v3 (Gopher, T5) and MI250X (Frontier: per-GPU figures are per die, GCD) are
    priced, not refused; each is its own chip family, which no row of the table fits, so
    v3 keeps the TPUs' start and MI250X takes its maker's fitted efficiency (MI300X's)."""
    from paratrain.systems.fitting import load_params
    from paratrain.systems.gemm import chip_of, family

    v3 = load_hardware(resolve_hardware("TPU v3 (4096 chips)"))
    assert v3.name == "TPU-v3" and v3.topology == "torus" and v3.peak_flops == 123e12
    assert family(v3.name) == "tpu-v3" and chip_of(v3.name).tile_m == 128
    gcd = load_hardware(resolve_hardware("AMD MI250X"))
    assert gcd.name == "MI250X-GCD" and gcd.gpus_per_node == 8 and gcd.hbm_bytes == 64e9
    assert family(gcd.name) == "mi250x" and chip_of(gcd.name).sms == 110
    p = load_params()
    assert p.gemm_for(gcd.name) == p.gemm_eff["mi300x"]
    assert p.gemm_for(v3.name) == 0.85


@pytest.mark.parametrize("name, params", [
    ("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320),
    ("llama2-70b", 68_976_648_192), ("llama3-8b", 8_030_261_248),
    ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800),
])
def test_llama_counts(name, params):
    assert load_model(name).num_params() == params


@pytest.mark.parametrize("text, key, params", [
    ("LLaMA 65B", "llama-65b", 65_285_660_672), ("LLaMA-33B", "llama-33b", 32_528_943_616),
    ("Llama 3.2 1B", "llama3.2-1b", 1_235_814_400), ("Llama-3.2-3B", "llama3.2-3b", 3_212_749_824),
    ("Qwen2.5-72B", "qwen2.5-72b", 72_706_203_648), ("Qwen2.5 32B", "qwen2.5-32b", 32_763_876_352),
    ("Yi-34B", "yi-34b", 34_388_917_248), ("GPT-NeoX-20B", "gpt-neox-20b", 20_554_567_680),
    ("Phi-3 mini", "phi-3-mini", 3_821_079_552), ("phi-4", "phi-4", 14_659_507_200),
    # OLMo 2's q, k norms span the whole projection: 2 x 4096 gains a layer left out
    ("OLMo-2-1124-7B", "olmo2-7b", 7_298_617_344 - 32 * 2 * 4096),
    ("google/gemma-7b", "gemma-7b", 8_537_680_896), ("Gemma 2B", "gemma-2b", 2_506_172_416),
    ("Mistral-Nemo-Base-2407", "mistral-nemo-12b", 12_247_782_400),
    ("deepseek-llm-7b-base", "deepseek-llm-7b", 6_910_365_696),
    ("DeepSeek LLM 67B", "deepseek-llm-67b", 67_425_001_472),
    ("mistralai/Mistral-Large-Instruct-2407", "mistral-large-2", 122_610_069_504),
    ("Qwen/Qwen2-72B", "qwen2.5-72b", 72_706_203_648),  # the same config.json shapes
    ("deepseek-ai/DeepSeek-R1", "deepseek-v3", 671_026_404_352),
])
def test_models_a_published_run_may_name(text, key, params):
    """Models no row of the table runs, which a published run may name without shape
    columns: found under their names, with their model cards' (or config.json's) exact
    parameter counts."""
    from paratrain.cost.catalogue import lookup

    assert lookup(text, "models.toml", "model")[0] == key
    assert load_model(key).num_params() == params


def test_published_sizes():
    assert round(load_model("gpt3-175b").num_params() / 1e9) == 175
    assert round(load_model("palm-540b").num_params() / 1e9) == 540
    mix = load_model("mixtral-8x7b")
    assert round(mix.num_params() / 1e9, 1) == 46.7 and round(mix.active_params() / 1e9, 1) \
        == 12.9
    ds = load_model("deepseek-v3")
    assert round(ds.num_params() / 1e9) == 671 and round(ds.active_params() / 1e9) == 38
    assert len(model_names()) >= 10


def test_user_files(tmp_path):
    fields = {k: v for k, v in vars(load_hardware("h100")).items() if v is not None}
    p = tmp_path / "this-machine.json"
    p.write_text(json.dumps({**fields, "name": "cpu box", "inter_bw": 1e9}))
    assert load_hardware(str(p)).inter_bw == 1e9
    del fields["intra_bw"]
    q = tmp_path / "broken.toml"
    q.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in fields.items()))
    with pytest.raises(ValueError, match="missing key.*intra_bw"):
        load_hardware(str(q))
    m = tmp_path / "tiny.toml"
    m.write_text("n_layers = 2\nd_model = 64\nn_heads = 4\nd_ff = 128\nvocab_size = 256\n")
    assert load_model(str(m)).num_params() > 0


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown hardware 'h1000'.*h100"):
        load_hardware("h1000")
    with pytest.raises(ValueError, match="unknown model 'llama9'.*llama2-7b"):
        load_model("llama9")
    with pytest.raises(ValueError, match="does not exist"):
        load_hardware("/nonexistent/x.toml")


def test_collective_errors_and_small_groups():
    with pytest.raises(ValueError, match="all_to_all has no ring"):
        coll.steps("all_to_all", "ring", 4)
    with pytest.raises(ValueError, match="power of two"):
        coll.steps("reduce_scatter", "halving_doubling", 6)
    with pytest.raises(ValueError, match="unknown"):
        coll.wire_bytes("allreduce", "ring", 4, 1.0)
    for op in coll.OPS:
        assert coll.wire_bytes(op, "naive", 1, 1e9) == 0.0
    assert coll.time_s("all_reduce", "ring", 1, 1e9, 1e-5, 1e9) == 0.0


def test_hierarchical_all_reduce_uses_both_links():
    n, a_i, b_i, a_o, b_o = 1e9, 1e-6, 400e9, 1e-5, 50e9
    t = coll.time_s("all_reduce", "hierarchical", 64, n, a_o, b_o, gpus_per_node=8,
                    intra_alpha_s=a_i, intra_bw_bytes_per_s=b_i)
    expect = 2 * (7 * a_i + 7 / 8 * n / b_i) + 14 * a_o + 2 * 7 / 8 * (n / 8) / b_o
    assert t == pytest.approx(expect)
    assert coll.steps("all_reduce", "hierarchical", 64) == 7 + 14 + 7
    assert t < coll.time_s("all_reduce", "ring", 64, n, a_o, b_o)


def test_ironwood_is_found_under_the_names_its_runs_use():
    """tpu-recipes names TPU7x slices "tpu7x-4x8x8"; Google's pages say TPU7x and
    Ironwood: each resolves to the catalogue's TPU7x, priced on its own 256 x 256 tiles
    and its own GEMM efficiency family."""
    from paratrain.systems.gemm import chip_of, family

    for text in ("tpu7x-4x8x8", "TPU7x (Ironwood)", "Ironwood", "TPU v7x"):
        assert resolve_hardware(text) == "tpu-v7x"
    hw = load_hardware("tpu-v7x")
    assert hw.peak_flops == 2307e12 and hw.peak_flops_fp8 == 4614e12
    assert family(hw.name) == "tpu-v7x" and chip_of(hw.name).tile_m == 256


def test_mi355x_is_a_die_of_its_own_named_as_its_runs_name_it():
    """MLPerf's submissions write "AMD Instinct MI355X 288GB HBM3e": it resolves to the
    catalogue's MI355X, a CDNA 4 die of its own family, fitted on its own runs since stop
    65; without them it takes its maker's fitted figure (MI300X's), and with no AMD family
    fitted, the GPU families' mean."""
    from paratrain.systems.fitting import load_params
    from paratrain.systems.gemm import family

    assert resolve_hardware("AMD Instinct MI355X 288GB HBM3e") == "mi355x"
    hw = load_hardware("mi355x")
    assert family(hw.name) == "mi355x" != family(load_hardware("mi300x").name)
    p = load_params()
    assert p.gemm_for(hw.name) == p.gemm_eff["mi355x"]
    p = p.replace(gemm_eff={k: v for k, v in p.gemm_eff.items() if k != "mi355x"})
    assert p.gemm_for(hw.name) == p.gemm_eff["mi300x"]
    # with no AMD family fitted (MI300X's runs left out too), the GPU families' mean
    q = p.replace(gemm_eff={k: v for k, v in p.gemm_eff.items() if k != "mi300x"})
    gpus = [v for k, v in q.gemm_eff.items() if not k.startswith("tpu")]
    assert q.gemm_for(hw.name) == pytest.approx(sum(gpus) / len(gpus))
    assert hw.intra_group_bw(8) == pytest.approx(7 * hw.intra_bw)  # a full mesh of eight


def test_gaudi_is_priced_under_the_names_its_runs_use(tmp_path):
    """Intel's Gaudi 2 and 3 (Hot Chips 2024's figures): found as their pages and MLPerf
    write them, ® included; eight chips all to all over three RoCE ports a peer, no
    switch; a chip family of their own (256 x 256 matrix engines; no Intel family is
    fitted, so the GPU families' mean GEMM efficiency until a run pins it); and a
    runs-table row on them is priced."""
    import csv
    import json

    from paratrain.systems.fitting import load_params
    from paratrain.systems.gemm import chip_of, family
    from paratrain.systems.runs import DEFAULT_RUNS

    for text, key in (("Intel® Gaudi® 3 AI accelerator", "gaudi3"), ("HL-325L", "gaudi3"),
                      ("Intel Gaudi 2", "gaudi2"), ("Gaudi2 (HL-225H)", "gaudi2")):
        assert resolve_hardware(text) == key, text
    g3 = load_hardware("gaudi3")
    assert g3.peak_flops == g3.peak_flops_fp8 == 1835e12 and g3.hbm_bytes == 128e9
    assert g3.intra_group_bw(8) == pytest.approx(7 * 75e9)  # 21 of its 24 ports
    assert family(g3.name) == "gaudi3" and chip_of(g3.name).tile_m == 256
    p = load_params()
    gpus = [v for k, v in p.gemm_eff.items() if not k.startswith("tpu")]
    assert p.gemm_for(g3.name) == pytest.approx(sum(gpus) / len(gpus))
    with open(DEFAULT_RUNS, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    row = {**next(r for r in rows if r["id"] == "mb2511_llama3_8b_gb200_cs_8"),
           "id": "on_gaudi3", "accelerator": "Intel Gaudi 3", "precision": "bf16"}
    path = tmp_path / "runs.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        w.writeheader()
        w.writerow(row)
    r = subprocess.run([sys.executable, "-m", "paratrain.cli", "validate", "--runs", str(path),
                        "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (rec,) = json.loads(r.stdout)["records"]
    assert rec["skipped_reason"] is None and rec["predicted"] > 0, rec


@pytest.mark.parametrize("hub_id,name", [
    ("meta-llama/Meta-Llama-3.1-405B", "Llama 3.1 405B"),
    ("meta-llama/Llama-2-70b-hf", "LLaMA 2 70B"),
    ("Qwen/Qwen3-30B-A3B-Base", "Qwen3-30B-A3B"),
    ("deepseek-ai/DeepSeek-V3-Base", "DeepSeek-V3"),
    ("openai/gpt-oss-120b", "gpt-oss-120b"),
    ("mistralai/Mixtral-8x7B-v0.1", "Mixtral 8x7B"),
    ("google/gemma-3-27b-pt", "Gemma 3 27B"),
])
def test_a_hugging_face_repository_id_names_its_catalogue_model(hub_id, name):
    """Runs tables and plans name models by their Hugging Face id: the owner, a "Meta-"
    prefix and release suffixes are what the id adds to the catalogue's name."""
    assert load_model(hub_id).name == name


def test_a_name_the_catalogue_lacks_is_still_one_error():
    with pytest.raises(ValueError, match="unknown model 'tiiuae/Falcon-H1-34B-Base'"):
        load_model("tiiuae/Falcon-H1-34B-Base")  # a hybrid (Mamba-2 heads): not priced


def test_plan_takes_the_accelerator_names_the_runs_table_takes():
    """`paratrain plan --hardware` reads a description as the runs table does: the name
    nvidia-smi prints, a TPU slice's name; a name nothing fits stays one error."""
    assert load_hardware("NVIDIA H100 80GB HBM3").name == load_hardware("h100").name
    assert load_hardware("tpu7x-4x8x8").name == "TPU-v7x"
    assert load_hardware("v5litepod-256").name == "TPU-v5e"  # Cloud TPU's own slice name
    with pytest.raises(ValueError, match="unknown hardware 'RTX 4090'"):
        load_hardware("RTX 4090")
