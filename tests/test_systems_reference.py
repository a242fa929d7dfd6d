"""Every figure of DESIGN.md's reference table, to its printed digits, from the public API.

LLaMA 2 7B (6,738,415,616 parameters) on H100 SXM servers: 8 GPUs per node on NVLink at
450 GB/s, 50 GB/s network per GPU, 989 TFLOP/s dense BF16, eta = 0.473; 1,048,576 tokens
per step at sequence 4096 on 64 GPUs. GB = 1e9 bytes.
"""

from __future__ import annotations

import pytest

from paratrain.cost import collectives as coll
from paratrain.cost.hardware import load_hardware
from paratrain.cost.memory import model_states_bytes
from paratrain.cost.shapes import load_model
from paratrain.plan import ParallelPlan
from paratrain.systems.step_time import dp_sync_wire_bytes, step_time

GB = 1e9
TOKENS, SEQ = 1_048_576, 4096


@pytest.fixture(scope="module")
def llama():
    return load_model("llama2-7b")


@pytest.fixture(scope="module")
def h100():
    return load_hardware("h100")


@pytest.fixture(scope="module")
def payload(llama):
    return 2 * llama.num_params()


def test_parameter_count_and_payload(llama, payload):
    assert llama.num_params() == 6_738_415_616
    assert round(payload / GB, 1) == 13.5


def test_hardware_figures(h100):
    assert (h100.peak_flops, h100.intra_bw, h100.inter_bw) == (989e12, 450e9, 50e9)
    assert (h100.gpus_per_node, h100.eta, h100.hbm_bytes) == (8, 0.473, 80e9)


def test_ring_all_reduce_8_gpus_nvlink(h100, payload):
    t = coll.time_s("all_reduce", "ring", 8, payload, h100.intra_alpha, h100.intra_bw)
    assert round(t, 3) == 0.052
    assert coll.steps("all_reduce", "ring", 8) == 14


def test_ring_all_reduce_64_gpus_network(h100, payload):
    t = coll.time_s("all_reduce", "ring", 64, payload, h100.inter_alpha, h100.inter_bw)
    assert round(t, 2) == 0.53
    assert round(coll.wire_bytes("all_reduce", "ring", 64, payload) / GB, 1) == 26.5


def test_naive_tree_all_reduce_64_gpus(h100, payload):
    t = coll.time_s("all_reduce", "tree", 64, payload, h100.inter_alpha, h100.inter_bw)
    assert round(t, 1) == 3.2
    assert coll.steps("all_reduce", "tree", 64) == 12  # 2 log2 p levels


@pytest.mark.parametrize("zero, gb", [(0, 107.8), (1, 28.2), (2, 15.0), (3, 1.7)])
def test_model_states_per_gpu(llama, zero, gb):
    b = model_states_bytes(llama, ParallelPlan(dp=64, zero=zero))
    assert round(b / GB, 1) == gb


def test_zero_wire_bytes(payload):
    assert round(dp_sync_wire_bytes(payload, 64, 3) / GB, 1) == 39.8
    for z in (0, 1, 2):  # ZeRO-1 and -2 send no more than plain data parallelism
        assert round(dp_sync_wire_bytes(payload, 64, z) / GB, 1) == 26.5


def test_compute_step_time_and_mfu(llama, h100):
    st = step_time(llama, ParallelPlan(dp=64), h100, TOKENS, SEQ)
    assert round(st.compute_s, 2) == 1.64
    assert round(st.step_sync_s, 2) == 2.17
    assert round(st.step_overlap_s, 2) == 1.64
    assert round(100 * st.mfu_sync, 1) == 35.7
    assert round(100 * st.mfu_overlap, 1) == 47.3
    assert st.hfu_overlap == pytest.approx(st.mfu_overlap)  # no recomputation


def test_zero3_step_uses_its_wire_bytes(llama, h100):
    st = step_time(llama, ParallelPlan(dp=64, zero=3), h100, TOKENS, SEQ)
    assert round(st.dp_wire_bytes / GB, 1) == 39.8
    assert st.step_sync_s > step_time(llama, ParallelPlan(dp=64), h100, TOKENS, SEQ).step_sync_s
