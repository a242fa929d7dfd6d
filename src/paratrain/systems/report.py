"""The `paratrain plan` report: one dict of numbers (for --json) and rich tables of it.

The default arguments are docs/design.md's worked example (LLaMA 2 7B, 64 H100,
1,048,576 tokens per step, sequence 4096), and the tables show each of its reference
figures at the precision docs/design.md prints.
"""

from __future__ import annotations

import math

from paratrain.config import ModelConfig
from paratrain.cost import collectives as coll
from paratrain.cost.dp_bytes import top_useful_zero
from paratrain.cost.hardware import Hardware
from paratrain.cost.memory import memory, params_per_gpu, recipe
from paratrain.cost.shapes import as_shape
from paratrain.plan import ParallelPlan
from paratrain.systems.step_time import OVERLAP_FRACTION, dp_sync_wire_bytes, step_time

GB = 1e9


def build_report(model: ModelConfig, hw: Hardware, plan: ParallelPlan, tokens_per_step: int,
                 seq_len: int, *, eta: float | None = None,
                 overlap_fraction: float = OVERLAP_FRACTION,
                 precision: str = "bf16-adam", step_kwargs: dict | None = None,
                 attention: str = "flash") -> dict:
    """Every number `paratrain plan` shows, in SI units (bytes, seconds, fractions).

    ``attention`` is the kernel whose saved activations are priced (``flash`` keeps no
    s x s scores; ``eager`` keeps them: :func:`paratrain.cost.memory.block_activation_bytes`).
    ``step_kwargs`` go to :func:`step_time` (e.g. a fitted ``dp_algorithm`` and
    ``overhead_width`` from ``paratrain validate --fit``)."""
    m = as_shape(model)
    plan.check(m, global_batch=tokens_per_step // seq_len if seq_len else None)
    if eta is not None:
        hw = hw.replace(eta=eta)
    prec = recipe(precision)
    d = plan.dp * plan.cp
    payload = params_per_gpu(m, plan).total * prec.grad_bytes
    node = min(hw.gpus_per_node, plan.world_size)
    a_d, bw_d = hw.link((d - 1) * plan.tp + 1, d)
    sync = {
        "payload_bytes": payload,
        "node_gpus": node,
        "ring_allreduce_node_s": coll.time_s("all_reduce", "ring", node, payload,
                                             hw.intra_alpha, hw.intra_group_bw(node)),
        "dp_gpus": d,
        "dp_link": "intra" if (d - 1) * plan.tp + 1 <= hw.gpus_per_node else "inter",
        "ring_allreduce_dp_s": coll.time_s("all_reduce", "ring", d, payload, a_d, bw_d),
        "ring_allreduce_dp_wire_bytes": coll.wire_bytes("all_reduce", "ring", d, payload),
        "tree_allreduce_dp_s": coll.time_s("all_reduce", "tree", d, payload, a_d, bw_d),
    }
    zero_rows = []
    for z in range(4):
        pz = plan.replace(zero=z, dp_replicate=plan.dp_replicate if z else 1)
        mem = memory(m, pz, hw, tokens_per_step, seq_len, prec, attention)
        zero_rows.append({
            "zero": z,
            "weights_bytes": mem.weights_bytes,
            "grads_bytes": mem.grads_bytes,
            "optimizer_bytes": mem.optimizer_bytes,
            "activations_bytes": mem.activations_bytes + mem.logits_bytes,
            "buffers_bytes": mem.buffers_bytes,
            "states_bytes": mem.states_bytes,
            "total_bytes": mem.total_bytes,
            "fits": mem.fits,
            "wire_bytes": dp_sync_wire_bytes(payload, d, z, plan.micro_batches, plan.pp > 1,
                                             pz.dp_replicate),
        })
    mem = memory(m, plan, hw, tokens_per_step, seq_len, prec, attention)
    st = step_time(m, plan, hw, tokens_per_step, seq_len, overlap_fraction=overlap_fraction,
                   precision=prec, **(step_kwargs or {}))
    return {
        "model": {"name": m.name, "params": m.num_params(), "active_params": m.active_params(),
                  "n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
                  "flops_per_token": m.flops_per_token(seq_len)},
        "hardware": {"name": hw.name, "peak_flops": hw.peak_flops, "hbm_bytes": hw.hbm_bytes,
                     "gpus_per_node": hw.gpus_per_node, "intra_bw": hw.intra_bw,
                     "inter_bw": hw.inter_bw, "eta": hw.eta},
        "plan": {"gpus": plan.world_size, "dp": plan.dp, "tp": plan.tp, "pp": plan.pp,
                 "cp": plan.cp, "ep": plan.ep, "zero": plan.zero,
                 "dp_replicate": plan.dp_replicate, "sp": plan.sp,
                 "micro_batches": plan.micro_batches, "schedule": plan.schedule,
                 "virtual_stages": plan.virtual_stages, "recompute": plan.recompute,
                 "overlap": plan.overlap, "tokens_per_step": tokens_per_step,
                 "seq_len": seq_len, "precision": precision, "attention": attention},
        "gradient_sync": sync,
        "zero": zero_rows,
        "memory": {"weights_bytes": mem.weights_bytes, "grads_bytes": mem.grads_bytes,
                   "optimizer_bytes": mem.optimizer_bytes,
                   "activations_bytes": mem.activations_bytes,
                   "logits_bytes": mem.logits_bytes, "buffers_bytes": mem.buffers_bytes,
                   "total_bytes": mem.total_bytes, "hbm_bytes": mem.hbm_bytes,
                   "margin_bytes": mem.margin_bytes, "fits": mem.fits},
        "step": {"compute_s": st.compute_s, "bubble_s": st.bubble_s,
                 "dp_comm_s": st.dp_comm_s, "dp_exposed_s": st.dp_exposed_s,
                 "tp_comm_s": st.tp_comm_s, "pp_comm_s": st.pp_comm_s,
                 "cp_comm_s": st.cp_comm_s, "cp_exposed_s": st.cp_exposed_s,
                 "ep_comm_s": st.ep_comm_s, "exposed_comm_s": st.exposed_comm_s,
                 "step_sync_s": st.step_sync_s, "step_overlap_s": st.step_overlap_s,
                 "mfu_sync": st.mfu_sync, "mfu_overlap": st.mfu_overlap,
                 "hfu_sync": st.hfu_sync, "hfu_overlap": st.hfu_overlap,
                 "model_flops": st.model_flops, "hardware_flops": st.hardware_flops,
                 "dp_wire_bytes": st.dp_wire_bytes, "tp_wire_bytes": st.tp_wire_bytes,
                 "tokens_per_s": tokens_per_step / st.step_s},
    }


# ---- formatting ------------------------------------------------------------------------
def fmt_sig(x: float, sig: int) -> str:
    """``x`` to ``sig`` significant digits, without exponent (0.052, 0.53, 3.2)."""
    if x == 0:
        return "0"
    decimals = max(0, sig - 1 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def fmt_gb(x_bytes: float) -> str:
    """Gigabytes (1e9) with one decimal (107.8, 1.7); two significant digits below 1."""
    gb = x_bytes / GB
    return f"{gb:,.1f}" if abs(gb) >= 1 or gb == 0 else fmt_sig(gb, 2)


def fmt_pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def render(rep: dict, console=None) -> None:
    """Print the report as rich tables."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    mo, hw, pl, sy = rep["model"], rep["hardware"], rep["plan"], rep["gradient_sync"]
    con.print(
        f"[bold]{mo['name']}[/] ({mo['params']:,} parameters) on {pl['gpus']} x {hw['name']}, "
        f"{pl['tokens_per_step']:,} tokens/step, sequence {pl['seq_len']}; "
        f"dp {pl['dp']} tp {pl['tp']} pp {pl['pp']} cp {pl['cp']} ep {pl['ep']}, "
        f"ZeRO-{pl['zero']}, {pl['micro_batches']} micro-batch(es), {pl['schedule']}, "
        f"recompute {pl['recompute']}, {pl['attention']} attention, eta {hw['eta']}"
    )
    link = "the network" if sy["dp_link"] == "inter" else "the node link"
    t = Table(title="Gradient sync (BF16 gradients of one GPU's parameters)")
    t.add_column("quantity")
    t.add_column("figure", justify="right")
    t.add_row("gradient payload", f"{fmt_gb(sy['payload_bytes'])} GB")
    t.add_row(f"ring all-reduce, {sy['node_gpus']} GPUs in a node",
              f"{fmt_sig(sy['ring_allreduce_node_s'], 2)} s")
    t.add_row(f"ring all-reduce, {sy['dp_gpus']} GPUs on {link}",
              f"{fmt_sig(sy['ring_allreduce_dp_s'], 2)} s")
    t.add_row(f"wire bytes per GPU, ring all-reduce among {sy['dp_gpus']}",
              f"{fmt_gb(sy['ring_allreduce_dp_wire_bytes'])} GB")
    t.add_row(f"naive binary tree all-reduce, {sy['dp_gpus']} GPUs",
              f"{fmt_sig(sy['tree_allreduce_dp_s'], 2)} s")
    con.print(t)

    t = Table(title=f"Model states per GPU, {sy['dp_gpus']}-way data parallel "
                    f"(HBM {fmt_gb(hw['hbm_bytes'])} GB)")
    for c in ("sharding", "states GB", "wire GB/step", "with activations GB", "fits"):
        t.add_column(c, justify="left" if c == "sharding" else "right")
    names = ["none", "ZeRO-1", "ZeRO-2", "ZeRO-3 / FSDP"]
    for row in rep["zero"]:
        mark = " *" if row["zero"] == pl["zero"] else ""
        t.add_row(names[row["zero"]] + mark, fmt_gb(row["states_bytes"]),
                  fmt_gb(row["wire_bytes"]), fmt_gb(row["total_bytes"]),
                  "yes" if row["fits"] else "[red]no[/]")
    con.print(t)

    me = rep["memory"]
    title = f"Memory per GPU (ZeRO-{pl['zero']}, busiest rank)"
    t = Table(title=title, min_width=len(title))  # the title on one line
    t.add_column("component")
    t.add_column("GB", justify="right")
    for k in ("weights", "grads", "optimizer", "activations", "logits", "buffers"):
        t.add_row(k, fmt_gb(me[f"{k}_bytes"]))
    t.add_row("[bold]total[/]", f"[bold]{fmt_gb(me['total_bytes'])}[/]")
    t.add_row("HBM", fmt_gb(me["hbm_bytes"]))
    con.print(t)
    if me["fits"]:
        con.print(f"verdict: fits, {fmt_gb(me['margin_bytes'])} GB to spare")
    else:
        higher_zero = pl["zero"] < top_useful_zero(pl["pp"] > 1)
        con.print(f"verdict: [red]does not fit[/], {fmt_gb(-me['margin_bytes'])} GB over; "
                  "try --recompute full, more --micro-batches, "
                  + ("a higher --zero, " if higher_zero else "") + "--tp or --pp")

    s = rep["step"]
    # the step model's prediction, when the command adds it, follows this table
    t = Table(title="Step time, reference model (docs/design.md: one eta, flat ring)")
    t.add_column("quantity")
    t.add_column("figure", justify="right")
    t.add_row("compute", f"{fmt_sig(s['compute_s'], 3)} s")
    if pl["pp"] > 1:
        t.add_row("pipeline bubble", f"{fmt_sig(s['bubble_s'], 3)} s")
    t.add_row("data-parallel sync on the wire (exposed)",
              f"{fmt_sig(s['dp_comm_s'], 3)} s ({fmt_sig(s['dp_exposed_s'], 2)} s)")
    for key, label in (("tp_comm_s", "tensor-parallel collectives"),
                       ("pp_comm_s", "pipeline sends"), ("cp_comm_s", "context-parallel KV"),
                       ("ep_comm_s", "expert all-to-all")):
        if s[key]:
            t.add_row(label, f"{fmt_sig(s[key], 3)} s")
    t.add_row("step, sync waits / overlapped",
              f"{fmt_sig(s['step_sync_s'], 3)} s / {fmt_sig(s['step_overlap_s'], 3)} s")
    t.add_row("MFU, sync waits / overlapped",
              f"{fmt_pct(s['mfu_sync'])} / {fmt_pct(s['mfu_overlap'])}")
    t.add_row("HFU, sync waits / overlapped",
              f"{fmt_pct(s['hfu_sync'])} / {fmt_pct(s['hfu_overlap'])}")
    t.add_row("throughput", f"{s['tokens_per_s']:,.0f} tokens/s")
    con.print(t)
