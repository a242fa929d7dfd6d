"""`paratrain validate`: published runs, error arithmetic, fitting, CLI."""

from __future__ import annotations

import csv
import io
import json

import pytest
from rich.console import Console

from paratrain.cli import main
from paratrain.systems.validate import (
    DEFAULT_RUNS,
    Params,
    Record,
    cases_and_skips,
    fit,
    load_params,
    predict,
    read_runs,
    render_validate,
    row_to_case,
    run_validate,
    summarize,
)


def _write(path, rows):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_error_arithmetic_on_three_rows():
    recs = [Record("a", "s1", "mfu", 0.50, 0.45), Record("b", "s2", "hfu", 0.40, 0.44),
            Record("c", "s2", "tflops", 100.0, 110.0), Record("d", "s2", None, None, None, "x")]
    s = summarize(recs)
    assert s["overall"]["n"] == 3 and s["skipped"] == 1
    assert s["overall"]["mape"] == pytest.approx((10 + 10 + 10) / 3)
    assert s["overall"]["mae_pp"] == pytest.approx((5 + 4) / 2)
    assert s["overall"]["mae_tflops"] == pytest.approx(10)
    assert s["per_source"]["s1"]["mape"] == pytest.approx(10)
    assert s["per_source"]["s2"]["n"] == 2
    assert recs[1].error == pytest.approx(0.04) and recs[1].abs_pct_error == pytest.approx(10)


def test_toy_table_prices_like_for_like_and_lists_skips(tmp_path):
    rows = read_runs()
    by_id = {r["id"]: r for r in rows}
    toy = [dict(by_id["dgxc_gpt3_175b_128"]), dict(by_id["narayanan21_t1_1.7B"]),
           dict(by_id["bloom_176b"])]
    toy[2]["layers"] = ""  # cannot be priced: shape incomplete and the model is not catalogued
    toy[2]["model"] = "an uncatalogued 176B model"
    toy[1]["hfu_pct"] = ""  # only TFLOP/s (hardware FLOPs) left
    toy[0]["tokens_per_s_per_accel"] = toy[0]["step_time_s"] = ""  # only MFU left
    res = run_validate(str(_write(tmp_path / "toy.csv", toy)), None, True, False, (), None)
    recs = {r["id"]: r for r in res["records"]}
    assert recs["dgxc_gpt3_175b_128"]["metric"] == "mfu"
    assert recs["dgxc_gpt3_175b_128"]["reported"] == pytest.approx(0.5354)
    assert recs["narayanan21_t1_1.7B"]["metric"] == "tflops"
    assert recs["narayanan21_t1_1.7B"]["reported"] == 137
    assert "model shape incomplete" in recs["bloom_176b"]["skipped_reason"]
    assert recs["bloom_176b"]["predicted"] is None
    priced = [r for r in res["records"] if r["predicted"] is not None]
    mape = sum(abs(r["predicted"] - r["reported"]) / r["reported"] for r in priced) / 2 * 100
    assert res["summary"]["overall"]["mape"] == pytest.approx(mape)


def test_a_blank_metric_scores_throughput_first():
    # tokens/s needs neither the source's FLOP count nor the peak its MFU divides by
    row = {**{r["id"]: r for r in read_runs()}["dgxc_gpt3_175b_128"], "metric": ""}
    case = row_to_case(row)
    per_token = case.model.flops_per_token(case.seq_len)
    assert case.metric == "tflops" and case.tflops_kind == "model"
    assert case.reported == pytest.approx(float(row["tokens_per_s_per_accel"]) * per_token / 1e12)
    # a step time alone is throughput too, before the MFU beside it
    timed = row_to_case({**row, "tokens_per_s_per_accel": ""})
    assert timed.metric == "tflops" and timed.reported == pytest.approx(
        float(row["tokens_per_step"]) / float(row["step_time_s"]) / float(row["num_accel"])
        * per_token / 1e12)
    assert row_to_case({**row, "tokens_per_s_per_accel": "", "step_time_s": ""}).metric == "mfu"


def test_every_shipped_row_is_priced_and_fitted_defaults_are_good():
    rows = read_runs()
    cases, skips = cases_and_skips(rows)
    refused = [s for s in skips if s.skipped_reason.startswith("needs ")]  # no fit
    assert all(s.skipped_reason.startswith("confirmed=no") for s in skips if s not in refused)
    assert len(cases) == sum(r["confirmed"] != "no" for r in rows) - len(refused) > 150
    res = run_validate(None, None, False, False, None, None)
    # 10.1% (held out 11.6%) since Megatron-Bridge's 26.xx and Blackwell Ultra rows joined
    # (a release can move the same MoE layout by 1.5x, gpt-oss in BF16 on Blackwell is
    # 30-110% fast: docs/systems-model.md), and fms-fsdp's, flash-attention's, NeMo
    # 24.07's, gpu-recipes', torchtitan's Blackwell and one AutoModel row (6.7%); 10.9%
    # since stop 65's 75 runs from 17 sources joined (AMD's MI355X, nanotron's 64-node
    # runs 57-193% fast: docs/systems-model.md); the rows before them stay near 8.7%
    assert res["summary"]["overall"]["mape"] < 11.2
    assert res["summary_heldout"]["overall"]["mape"] < 12
    later = {r["id"] for r in rows if r["id"].startswith(("mb26", "tpur_", "amd_", "new"))
             or r["accelerator"].startswith(("GB300", "B300"))}
    before = [r for r in res["records"] if r["predicted"] is not None and r["id"] not in later]
    assert sum(r["abs_pct_error"] for r in before) / len(before) < 9
    p = load_params()
    assert 0.3 <= min(p.gemm_eff.values()) and max(p.gemm_eff.values()) <= 1.0


SYNTHETIC_IDS = ("narayanan21_t1_1.7B", "narayanan21_t1_145.6B",
                 "megascale_175b_megatronlm_256", "megascale_175b_megatronlm_12288",
                 "dgxc_gpt3_175b_128", "llama3_405b_8192_seq8192", "llama3_405b_16384_seq8192",
                 "narayanan21_t1_18.4B", "dgxc_llama31_8b_8", "dgxc_nemotron4_15b_16",
                 "mosaic_mpt7b_a100_80gb_8g_s2048", "titan_llama3_8b_a100_64_sacop",
                 "mosaic_mpt13b_h100_80gb_8g_s2048")
TRUTH = Params(gemm_eff={"a100": 0.7, "h100": 0.6}, attn_eff={"a100": 0.5, "h100": 0.3},
               attn3_eff=0.5, fp8_eff=0.9, hbm_eff=0.7, nvlink_eff=0.6, net_eff=0.7,
               kernel_s=5e-6)


def _synthetic_cases(scale: dict | None = None) -> list:
    """Shipped rows re-reported as TRUTH prices them (times ``scale[id]`` if given)."""
    out = []
    for r in read_runs():
        if r["id"] in SYNTHETIC_IDS:
            c = row_to_case(r)
            k = (scale or {}).get(r["id"], 1.0)
            out.append(c.__class__(**{**c.__dict__, "reported": k * predict(c, TRUTH)}))
    return out


def test_fit_recovers_parameters_from_synthetic_rows():
    """Rows priced by known parameters: the fit finds parameters that reproduce them, and
    the well-determined GEMM efficiencies themselves."""
    cases = _synthetic_cases()
    got = fit(cases, iters=40)
    assert got.gemm_eff["a100"] == pytest.approx(0.7, rel=0.05)
    assert got.gemm_eff["h100"] == pytest.approx(0.6, rel=0.05)
    for c in cases:
        assert predict(c, got) == pytest.approx(c.reported, rel=0.01)


def test_cli_json_records(capsys):
    assert main(["validate", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for r in res["records"]:
        assert {"id", "metric", "reported", "predicted", "skipped_reason"} <= set(r)
    rows = read_runs()
    refused = sum((r["skipped_reason"] or "").startswith("needs ")
                  for r in res["records"])  # cannot fit the HBM: docs/runs.md
    assert res["summary"]["overall"]["n"] == sum(r["confirmed"] != "no" for r in rows) - refused
    assert res["summary"]["skipped"] == sum(r["confirmed"] == "no" for r in rows) + refused
    assert "Narayanan et al." in res["summary"]["per_source"]


def test_a_fitted_family_loads_even_without_a_start_value(tmp_path):
    """A fit gives every chip family with enough rows its efficiencies (V100 and MI300X
    have no start value); loading keeps them, and drops a key that is no chip family. A
    fitted B200 was once lost this way: --fit printed 0.53, --params priced 0.75."""
    from paratrain.systems.fitting import write_params
    from paratrain.systems.step_params import StepParams

    fitted = StepParams().replace(gemm_eff={**StepParams().gemm_eff, "v100": 0.61,
                                            "mi300x": 0.52, "no-such-chip": 0.5})
    path = write_params(fitted, tmp_path / "fitted.toml", ["test"])
    p = load_params(path)
    assert p.gemm_for("V100-SXM2-32GB") == 0.61 and p.gemm_eff["mi300x"] == 0.52
    assert "no-such-chip" not in p.gemm_eff


def test_only_rows_that_run_a_flashattention2_kernel_fit_its_efficiency():
    """Blackwell has no FlashAttention-2 efficiency of its own: its few rows that run such
    a kernel (torchtitan's on B200 and GB200) inform Hopper's, at whose absolute rate the
    kernel runs there (step_params.LEGACY_MMA); H100's torchtitan rows fit it too."""
    from paratrain.systems.fit_rows import _prices_attn_eff
    from paratrain.systems.fit_rows import free_params as _names
    from paratrain.systems.runs import cases_and_skips

    cases = cases_and_skips(read_runs())[0]
    names = _names(cases)
    assert {("gemm_eff", "b200"), ("gemm_eff", "b300"), ("attn_eff", "h100")} <= set(names)
    assert not {("attn_eff", "b200"), ("attn_eff", "b300")} & set(names)
    blackwell = {c.id for c in cases if _prices_attn_eff(c) and "B200" in c.hw.name}
    assert {"titan_llama3_8b_b200_8_bf16", "titan_llama4_scout_gb200_256_bf16"} <= blackwell


def test_flashattention2_on_blackwell_runs_at_hoppers_absolute_rate():
    """A FlashAttention-2 class kernel (mma.sync) gains nothing from Blackwell's tensor
    cores: on B200 / B300 it runs at attn_eff[h100] x 989 TF/s, as a share of their own
    peak; their native kernel (cuDNN's, "flash3") at Blackwell's own native figure
    (attn3_bw_eff), Hopper's at attn3_eff, a TPU's attention at attn_tpu_eff."""
    from paratrain.cost.hardware import load_hardware
    from paratrain.systems.step_params import StepParams

    p = StepParams().replace(attn_eff={"a100": 0.6, "h100": 0.25}, attn3_eff=0.4,
                             attn3_bw_eff=0.7, attn_tpu_eff=0.5)
    for key in ("b200", "gb200", "b300", "gb300"):
        hw = load_hardware(key)
        rate = p.attn_for(hw.name, "flash", hw.peak_flops) * hw.peak_flops
        assert rate == pytest.approx(0.25 * 989e12), key
        assert p.attn_for(hw.name, "flash3", hw.peak_flops) == 0.7
    h100 = load_hardware("h100")
    assert p.attn_for(h100.name, "flash", h100.peak_flops) == 0.25
    assert p.attn_for(h100.name, "flash3", h100.peak_flops) == 0.4
    for key in ("tpu-v5p", "tpu-v7x"):
        tpu = load_hardware(key)
        assert p.attn_for(tpu.name, "flash", tpu.peak_flops) == 0.5


def test_the_first_flashattention_runs_at_half_flashattention2s_rate():
    """FlashAttention-2 is about twice as fast as FlashAttention (Dao 2023): a row whose
    engine cell names FlashAttention 1 (InternEvo's 1.0.5) prices its attention at half
    the family's FlashAttention-2 rate, and says so."""
    from paratrain.cost.hardware import load_hardware
    from paratrain.systems.fitting import breakdown, load_params
    from paratrain.systems.runs import row_to_case
    from paratrain.systems.step_params import FLASH1_SPEED, StepParams

    p = StepParams().replace(attn_eff={"a100": 0.6, "h100": 0.25})
    for key in ("a100", "h100", "b200"):
        hw = load_hardware(key)
        assert p.attn_for(hw.name, "flash1", hw.peak_flops) == pytest.approx(
            FLASH1_SPEED * p.attn_for(hw.name, "flash", hw.peak_flops)), key
    row = {r["id"]: r for r in read_runs()}["internevo_7b_a100_8_tp1_zero8"]
    case = row_to_case(row)
    assert dict(case.engine_options)["attention"] == "flash1"
    assert "'flashattention 1'" in case.engine_why
    fa2 = row_to_case({**row, "engine": "InternEvo"})
    assert dict(fa2.engine_options).get("attention") is None
    att = [breakdown(c, load_params()).gemm["attention"] for c in (case, fa2)]
    assert att[0] > 1.5 * att[1]  # the attention core's time; its GEMMs less so


def test_a_chip_no_parameter_names_takes_the_mean_of_its_kind():
    """MI250X and V100 have no row in the table, so no fitted efficiency: they take the
    mean of the GPU families' (a TPU family the mean of the TPUs'), not a start value."""
    from paratrain.systems.step_params import StepParams

    p = StepParams().replace(gemm_eff={"a100": 0.7, "h100": 0.6, "tpu-v4": 0.8,
                                       "tpu-v5p": 0.9})
    assert p.gemm_for("MI250X-GCD") == pytest.approx(0.65)
    assert p.gemm_for("V100-SXM2-32GB") == pytest.approx(0.65)
    assert p.gemm_for("TPU-v6e") == pytest.approx(0.85)
    assert p.gemm_for("H100-SXM5-80GB") == 0.6


def test_cli_fit_writes_parameters_and_holdout(tmp_path, capsys):
    rows = read_runs()
    keep = [r for r in rows if r["id"].startswith(("narayanan21_t1", "dgxc_gpt3"))]
    runs = _write(tmp_path / "runs.csv", keep)
    out = tmp_path / "fitted.toml"
    assert main(["validate", "--runs", str(runs), "--fit", "--out", str(out), "--holdout",
                 "narayanan21_t1_1008.0B,dgxc_gpt3_175b_2048", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["fit"]["holdout"]["overall"]["n"] == 2
    assert res["fit"]["loo"]["overall"]["n"] == len(keep) - 2
    p = load_params(out)
    assert {"a100", "h100"} <= set(p.gemm_eff)
    assert "leave-one-out MAPE" in out.read_text()
    assert res["fit"]["n_params"] <= 10 and res["fit"]["in_table"]["overall"]["n"] == \
        len(keep) - 2
    u = res["fit"]["uncertainty"]
    assert sorted(u["pinned"] + u["at_bound"] + u["not_pinned"]) == sorted(u["params"])
    assert "gemm_eff[a100]" in u["pinned"]  # ten A100 rows of Narayanan et al.
    assert all((e["sigma"] is None) == (k in u["not_pinned"]) for k, e in u["params"].items())
    assert main(["validate", "--runs", str(runs), "--params", str(out)]) == 0
    assert "overall: n=" in capsys.readouterr().out
    text = io.StringIO()
    render_validate(res, Console(file=text, width=80))
    lines = text.getvalue().splitlines()
    for k in u["pinned"]:  # each pinned one on its own line with its +/-, brackets kept
        assert any(line.split()[:1] == [k] and "+/-" in line for line in lines), k
    assert "not pinned by the runs: " in text.getvalue()
    # --no-loo: the same fit and held-out score without the row-by-row refits
    assert main(["validate", "--runs", str(runs), "--fit", "--no-loo", "--holdout",
                 "narayanan21_t1_1008.0B,dgxc_gpt3_175b_2048", "--json"]) == 0
    quick = json.loads(capsys.readouterr().out)["fit"]
    assert "loo" not in quick and quick["holdout"]["overall"]["n"] == 2
    assert quick["in_table"] == res["fit"]["in_table"]


def test_each_source_left_out_is_predicted_by_a_fit_that_never_saw_it():
    """Rows of six sources priced by known parameters: leaving any one out, the others pin
    the same efficiencies, so its rows come back as priced (within the warm-started
    fit's few iterations). A source on a chip no other source has gets no help from the
    full fit: that family goes back to its unfitted start (here 0.75 against a truth of
    0.5), so its rows are priced as a new chip's would be."""
    from paratrain.systems.fit_rows import unseen_start as _unseen_start
    from paratrain.systems.fitting import leave_source_out

    cases = _synthetic_cases()
    truth = TRUTH.replace(gemm_eff={**TRUTH.gemm_eff, "b200": 0.5})
    b200 = [row_to_case(r) for r in read_runs()
            if r["id"].startswith("mb2509_") and r["accelerator"] == "B200"][:3]
    b200 = [c.__class__(**{**c.__dict__, "source": "B200 only",
                           "reported": predict(c, truth)}) for c in b200]
    assert len({c.source for c in cases}) == 6 and len(b200) == 3
    recs = leave_source_out(cases + b200, cases + b200, truth)
    assert sorted(r.id for r in recs) == sorted(c.id for c in cases + b200)
    for r in recs:
        assert (r.abs_pct_error > 20) == (r.source == "B200 only"), (r.id, r.abs_pct_error)
        assert r.source == "B200 only" or r.abs_pct_error < 5, (r.id, r.abs_pct_error)
    seen = _unseen_start(truth.replace(gemm_eff={**truth.gemm_eff, "mi300x": 0.5}), cases)
    assert seen.gemm_eff["a100"] == 0.7 and seen.gemm_eff["b200"] == Params().gemm_eff["b200"]
    assert "mi300x" not in seen.gemm_eff


def test_a_scalar_only_the_left_out_source_informs_goes_back_to_its_start():
    """Row-scaled FP8 and a TPU's grouped expert GEMMs each have one source in the table:
    left out, its rows must be priced at the unfitted start, not at the rate the full fit
    took from those same rows (a free parameter no remaining row moves stays put)."""
    from paratrain.systems.fit_rows import free_params as _names
    from paratrain.systems.fit_rows import unseen_start as _unseen_start
    from paratrain.systems.runs import cases_and_skips

    rowwise = [c for c in cases_and_skips(read_runs())[0] if "rowwise" in c.precision]
    assert len(rowwise) >= 3
    full = Params().replace(fp8_rowwise_eff=0.6, tpu_gmm_eff=0.5)
    kept = _unseen_start(full, rowwise)
    assert ("fp8_rowwise_eff", None) in _names(rowwise) and kept.fp8_rowwise_eff == 0.6
    for rows in (_synthetic_cases(), rowwise[:2]):
        seen = _unseen_start(full, rows)
        assert ("fp8_rowwise_eff", None) not in _names(rows)
        assert seen.fp8_rowwise_eff == Params().fp8_rowwise_eff == 1.0
        assert seen.tpu_gmm_eff == Params().tpu_gmm_eff == 1.0


def test_cli_by_source_and_no_loo_need_the_fit(capsys):
    assert main(["validate", "--no-loo"]) == 2
    assert "add --fit" in capsys.readouterr().err
    assert main(["validate", "--by-source"]) == 2
    assert "add --fit" in capsys.readouterr().err


@pytest.mark.parametrize("args, msg", [
    (["--runs", "/nonexistent.csv"], "does not exist"),
    (["--fit", "--holdout", "no_such_row"], "no_such_row"),
    (["--params", "/nonexistent.toml"], "do not exist"),
])
def test_cli_bad_inputs(args, msg, capsys):
    assert main(["validate", *args]) == 2
    assert msg in capsys.readouterr().err


def test_shipped_table_is_package_data():
    assert DEFAULT_RUNS.is_file() and DEFAULT_RUNS.parent.name == "data"


def test_fit_minimises_absolute_error_so_one_wild_row_does_not_pull_it():
    """Rows priced by known parameters plus one reported 60% faster than they price it
    (a run with an unrecorded speed-up): the fit still finds the others' parameters and
    leaves the wild row's whole error on that row."""
    wild = "dgxc_nemotron4_15b_16"
    cases = _synthetic_cases({wild: 1.6})
    got = fit(cases, iters=40)
    assert got.gemm_eff["a100"] == pytest.approx(0.7, rel=0.02)
    assert got.gemm_eff["h100"] == pytest.approx(0.6, rel=0.02)
    for c in cases:
        err = abs(predict(c, got) / c.reported - 1)
        assert err > 0.35 if c.id == wild else err < 0.01, c.id


def _fit_rows(family: str | None, every: int) -> list:
    """Every ``every``-th priceable fit row of the shipped table (of one accelerator family,
    or of A100 and H100), re-reported as TRUTH prices them."""
    from paratrain.systems.validate import cases_and_skips, generation

    rows = [r for r in read_runs() if (r.get("split") or "").strip() != "heldout"]
    cases = cases_and_skips(rows)[0]
    fams = (family,) if family else ("a100", "h100")
    return [c for c in cases if generation(c.hw.name) in fams][::every]


def _noisy(cases: list, noise: float, seed: int = 0) -> list:
    """``cases`` re-reported as TRUTH prices them, times 1 + noise x a standard normal."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [c.__class__(**{**c.__dict__, "reported": predict(c, TRUTH)
                           * (1 + noise * rng.standard_normal())}) for c in cases]


def test_fit_reports_constants_the_rows_do_not_depend_on_as_not_pinned():
    """A100 rows only: H100's GEMM efficiency has no row (not fitted), nor Hopper's
    native attention (a narrow figure, fitted only with rows that run it), and the FP8
    GEMMs' efficiency is fitted but no BF16 A100 row uses it (a zero column of the
    Jacobian): all not pinned, while A100's GEMM efficiency is, tightly."""
    from paratrain.systems.validate import fit_with_errors

    cases = _noisy(_fit_rows("a100", 3), 0.0)
    u = fit_with_errors(cases).as_dict()
    assert {"gemm_eff[h100]", "attn3_eff", "fp8_eff"} <= set(u["not_pinned"])
    assert not u["params"]["gemm_eff[h100]"]["fitted"]
    assert not u["params"]["attn3_eff"]["fitted"] and u["params"]["fp8_eff"]["fitted"]
    assert u["params"]["fp8_eff"]["sigma"] is None
    assert "gemm_eff[a100]" in u["pinned"]
    assert u["params"]["gemm_eff[a100]"]["value"] == pytest.approx(0.7, abs=1e-5)
    assert u["params"]["gemm_eff[a100]"]["sigma"] < 1e-3


def test_fit_recovers_parameters_within_its_reported_uncertainty():
    """Rows priced by known parameters with 2% noise, three draws: each GEMM efficiency
    comes back pinned, with a +/- under 0.03, within 5 of its +/- of the truth in every
    draw and within 2 on average; without the noise the same fit is exact and its +/-
    vanishes (the residual variance scales it). The +/- is the Jacobian's, which for a
    fit in the absolute-error regime (soft_l1 past its knee) understates the spread: with
    Gaussian noise a least-absolute-deviation estimate varies pi/2 times as much as a
    least-squares one, 1.25 times its +/-, so 4 true standard deviations read as 5 (one
    draw has landed 4.0 +/- away since the table took its fms-fsdp, flash-attention and
    NeMo rows)."""
    from paratrain.systems.validate import fit_with_errors

    rows = _fit_rows(None, 4)
    draws = [fit_with_errors(_noisy(rows, 0.02, seed)).as_dict() for seed in range(3)]
    exact = fit_with_errors(_noisy(rows, 0.0)).as_dict()
    for fam, truth in TRUTH.gemm_eff.items():
        key = f"gemm_eff[{fam}]"
        z = []
        for noisy in draws:
            e = noisy["params"][key]
            assert key in noisy["pinned"] and 0 < e["sigma"] < 0.03, (key, e)
            z.append(abs(e["value"] - truth) / e["sigma"])
        assert max(z) < 5 and sum(z) / len(z) < 2, (key, z)
        assert exact["params"][key]["sigma"] < 1e-3 * draws[0]["params"][key]["sigma"]
        assert exact["params"][key]["value"] == pytest.approx(truth, abs=1e-5)
