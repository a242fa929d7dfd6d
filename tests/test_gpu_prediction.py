"""A run on CUDA GPUs prints the systems model's prediction beside what it measured
(paratrain.predict.gpu): the GPU's catalogue entry from torch's device name, the same
step model that prices published runs, the runtime's own state counts; what it cannot
price is one line saying why. Everything here is pure Python on injected summaries:
nothing needs a GPU (benchmarks/gpu_check.py runs the real thing where one is)."""

from __future__ import annotations

import pytest

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost import layout as L
from paratrain.cost.hardware import load_hardware, resolve_hardware
from paratrain.plan import ParallelPlan
from paratrain.predict import format_prediction, summary_row
from paratrain.predict.gpu import ENGINE, gpu_prediction
from paratrain.systems.step_model import predict_step

MCFG = ModelConfig(n_layers=4, d_model=256, n_heads=4, d_ff=1024, context=512)
TCFG = TrainConfig(global_batch=8, dtype="bfloat16")


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA B200", "b200"), ("AMD Instinct MI300X", "mi300x"),
])
def test_torch_device_names_resolve_to_catalogue_keys(name, key):
    assert resolve_hardware(name) == key


def test_an_unknown_device_name_is_a_value_error():
    with pytest.raises(ValueError, match="'Quadro RTX 6000' is not in the hardware catalogue"):
        resolve_hardware("Quadro RTX 6000")


def _summary(plan: ParallelPlan, step_s: float, exact: bool = True) -> dict:
    """What a run's summary holds, with model states measured as the layout counts them
    (``exact=False``: rank 0's optimizer one byte off)."""
    ranks = []
    for q in range(plan.world_size):
        st = dict(L.state_bytes(MCFG, plan, TCFG.dtype, q, TCFG.reduce_dtype))
        ranks.append({**st, "activations_peak": 1e8})
    if not exact:
        ranks[0]["optimizer"] += 1
    return {"step_s": step_s, "tokens_per_step": TCFG.global_batch * MCFG.context,
            "memory": {"measured_per_rank": ranks}}


def test_a_gpu_run_is_priced_by_the_step_model_on_its_catalogue_entry():
    plan = ParallelPlan(dp=2, tp=2, zero=3)
    rep = gpu_prediction(MCFG, TCFG, plan, 4, _summary(plan, 0.05), "NVIDIA H200", (4, 8))
    bd = predict_step(MCFG, plan, load_hardware("h200"), TCFG.global_batch * MCFG.context,
                      MCFG.context, engine_name=ENGINE)
    c = rep["vs_measured"]
    assert rep["gpu"]["hardware"] == "H200-SXM-141GB" and rep["gpu"]["engine"] == ENGINE
    assert c["step_s"]["predicted"] == bd.step_s
    assert c["step_s"]["error"] == pytest.approx(bd.step_s / 0.05 - 1)
    assert c["mfu"]["measured"] == pytest.approx(bd.model_flops / (0.05 * 4 * 989e12))
    assert c["mfu"]["predicted"] == pytest.approx(bd.mfu)
    assert c["states_bytes"]["exact"] and c["activations_bytes"]["measured"] == 1e8
    text = format_prediction(rep)
    assert text.splitlines()[0] == f"prediction (systems model, H200-SXM-141GB, engine {ENGINE})"
    assert "exact on every rank" in text and "MFU         predicted" in text
    assert summary_row(rep)[1].startswith(f"{bd.step_s:.4f}  (")


def test_states_that_differ_are_said_to():
    plan = ParallelPlan(dp=2)
    rep = gpu_prediction(MCFG, TCFG, plan, 2, _summary(plan, 0.05, exact=False),
                         load_hardware("h100"), (2, 8))
    assert not rep["vs_measured"]["states_bytes"]["exact"]
    assert "DIFFERENT" in format_prediction(rep)


@pytest.mark.parametrize("tcfg, device, node, reason", [
    (TCFG, "NVIDIA H200", (2, 1), "2 ranks share 1 GPU(s) on this node"),
    (TrainConfig(global_batch=8, dtype="float32"), "NVIDIA H200", (1, 1),
     "this run is float32 (pass --dtype bfloat16)"),
    (TCFG, "Quadro RTX 6000", (1, 1), "GPU 'Quadro RTX 6000' is not in the hardware catalogue"
     " (keys: "),
])
def test_what_it_cannot_price_is_one_line(tcfg, device, node, reason):
    plan = ParallelPlan(dp=node[0])
    rep = gpu_prediction(MCFG, tcfg, plan, node[0], _summary(plan, 0.05), device, node)
    assert set(rep) == {"skipped"} and reason in rep["skipped"]
    line = format_prediction(rep)
    assert line.startswith("prediction: not priced: ") and "\n" not in line
    assert summary_row(rep)[1].startswith("not priced: ")
