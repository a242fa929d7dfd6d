"""A runs-table row's layout: its parallel axes, batch split and pipeline schedule, each
blank filled in and listed as a default (column, value, why); docs/runs.md."""

from __future__ import annotations

import math

from paratrain.plan import SCHEDULES, V_SHAPED, infer_dp
from paratrain.systems.row_fields import Skip
from paratrain.systems.row_fields import num as _num
from paratrain.systems.row_words import schedule_said


def axes(row: dict, gpus: int, out: list, experts: int = 0, domain: int = 0
         ) -> tuple[int, int, int, int, int]:
    """(tp, pp, cp, ep, dp): a blank axis is 1, a blank DP what the others leave; with DP
    stated and one of TP, PP and CP blank, that one is what the others leave of the
    accelerators (more than one blank: each 1, and a product short of them refused); a
    blank EP of a model with ``experts`` the largest size DP x CP and the experts both
    divide, as most MoE recipes run it (1 would keep every expert on every rank), within
    the fast ``domain`` where one is given (EP x TP on NVLink: MaxText's EP inside a node,
    FSDP across)."""
    dp = _num(row, "DP", int)
    axes = {col: _num(row, col, int) for col in ("TP", "PP", "CP")}
    blank = [col for col, n in axes.items() if not n]
    stated = math.prod(n for n in axes.values() if n) * (dp or 0)
    for col in blank:
        if dp and blank == [col] and stated and gpus % stated == 0 and gpus > stated:
            axes[col] = gpus // stated
            out.append((col, axes[col], "blank: num_accel / the other axes (DP stated)"))
        else:
            axes[col] = 1
            out.append((col, 1, "blank: no parallelism on this axis"))
    tp, pp, cp = axes["TP"], axes["PP"], axes["CP"]
    if not dp:
        try:
            dp = infer_dp({"tp": tp, "pp": pp, "cp": cp}, gpus, "num_accel")["dp"]
        except ValueError as e:
            raise Skip(str(e), out) from None
        out.append(("DP", dp, "blank: num_accel / (TP x PP x CP)"))
    if tp * pp * dp * cp != gpus:
        raise Skip(f"TP*PP*DP*CP = {tp * pp * dp * cp} != num_accel {gpus}", out)
    ep = _num(row, "EP", int)
    if not ep and experts > 1:
        g = math.gcd(experts, dp * cp)
        cap = max(1, domain // tp) if domain else g
        ep = max(d for d in range(1, g + 1) if g % d == 0 and d <= cap)
        out.append(("EP", ep, "blank with experts: the largest size DP x CP and the experts "
                              "both divide" + (", within the fast domain" if domain else
                                               ", over all the data ranks (within the "
                                               "fast domain it does not fit)")))
    elif not ep:
        ep = 1
        out.append(("EP", 1, "blank: no parallelism on this axis"))
    return tp, pp, cp, ep, dp


def schedule(row: dict, pp: int, m: int, L: int, out: list) -> tuple[str, int]:
    """(schedule, virtual stages) from the ``schedule`` and ``vpp`` columns. Interleaving
    named without its depth: one block per virtual stage as far as the layers allow (Llama
    3's paper: a first chunk holding only the embedding); a vpp > 1 alone means
    interleaving, and 1F1B with a vpp > 1 is Megatron's interleaved 1F1B. The cell is read
    as sources write it (:func:`paratrain.systems.row_words.schedule_said`: "Interleaved
    1F1B", "zero bubble", "DualPipe", "PipeDream-Flush", ...). A schedule the layout
    cannot run falls back to 1F1B, said so."""
    cell = (row.get("schedule") or "").strip()
    named = schedule_said(cell) if cell else ""
    v = _num(row, "vpp", int)
    if named is None:
        raise Skip(f"schedule {cell.lower()!r} is unknown; use one of {', '.join(SCHEDULES)}",
                   out)
    if pp == 1:
        return "1f1b", 1
    if named == "1f1b" and v and v > 1:
        named = "interleaved"
        out.append(("schedule", named, f"{cell!r} with vpp {v}: Megatron's interleaved 1F1B"))
    if not named:
        named = "interleaved" if v and v > 1 else "1f1b"
        out.append(("schedule", named, "blank: vpp > 1 means interleaved" if v and v > 1
                    else "blank: 1F1B, Megatron-LM's default"))
    if named in V_SHAPED and not v:
        v = 2
        out.append(("vpp", v, f"blank with schedule {named}: two chunks a rank, in a V"))
    if named != "interleaved":
        return named, v or 1
    if not v:
        v = max(1, L // pp)
        out.append(("vpp", v, "blank with schedule interleaved: one block per virtual stage"))
    if v > 1 and m % pp == 0 and pp * v <= L:
        return "interleaved", v
    out.append(("schedule", "1f1b", f"interleaved needs vpp > 1, micro-batches ({m}) a "
                                    f"multiple of PP ({pp}) and PP x vpp <= layers ({L})"))
    return "1f1b", 1


def _timed_tokens(row: dict, gpus: int) -> float | None:
    """Tokens per step as a row's throughput and step time say: tokens/s per accelerator
    x step time x accelerators (None without both figures)."""
    tps, step = _num(row, "tokens_per_s_per_accel"), _num(row, "step_time_s")
    return tps * step * gpus if tps and step and gpus else None


def seq_len(row: dict, gpus: int, out: list) -> int:
    """The sequence length: the ``seq_len`` column, else what the batch columns divide
    to: tokens per step over sequences per step, the tokens taken from the throughput and
    step time where the row gives no ``tokens_per_step`` (rounded figures: the nearest
    multiple of 128, within 2%); Skip when nothing says it."""
    seq = _num(row, "seq_len", int)
    if seq:
        return seq
    seqs = _num(row, "global_batch_seqs", int)
    tokens, how = _num(row, "tokens_per_step", int), "tokens_per_step"
    if seqs and tokens and tokens % seqs == 0:
        seq = tokens // seqs
    elif seqs and not tokens and _timed_tokens(row, gpus):
        tokens, how = _timed_tokens(row, gpus), "tokens/s x step_time_s x num_accel"
        seq = 128 * round(tokens / seqs / 128)
        if not seq or abs(tokens / seqs / seq - 1) > 0.02:
            seq = 0
    if not seq:
        raise Skip("no seq_len (nor tokens and sequences per step that divide to one)", out)
    out.append(("seq_len", seq, f"blank: {how} / global_batch_seqs"))
    return seq


def _whole_batch(seqs: float, unit: int) -> int:
    """The batch a rounded throughput x step time stands for: the nearest number of
    sequences that ``unit`` (replicas x micro-batch) divides, if within 2% of ``seqs``,
    else 0. (Not the nearest power of two: dgxc-benchmarking's Llama 3.1 405B runs 126
    and 252 sequences.)"""
    near = unit * round(seqs / unit)
    return near if near and abs(seqs / near - 1) <= 0.02 else 0


def batch(row: dict, seq: int, dp: int, pp: int, out: list, gpus: int = 0
          ) -> tuple[int, int]:
    """(tokens per step, micro-batches per replica); a blank batch is what the row's
    throughput and step time make (rounded figures: the nearest number of sequences that
    the replicas and a stated micro-batch divide, within 2%); a blank micro-batch is one
    sequence under a pipeline, else the replica's whole batch (no accumulation)."""
    tokens = _num(row, "tokens_per_step", int)
    seqs = _num(row, "global_batch_seqs", int)
    if not tokens and seqs:
        tokens = seqs * seq
    timed = _timed_tokens(row, gpus)
    if not tokens and timed:
        tokens = _whole_batch(timed / seq, dp * (_num(row, "microbatch", int) or 1)) * seq
        if tokens:
            out.append(("global_batch_seqs", tokens // seq,
                        "blank: tokens/s x step_time_s x num_accel / seq_len"))
    if not tokens:
        raise Skip("no batch size (tokens_per_step or global_batch_seqs, or a throughput "
                   "and step time)", out)
    seqs = tokens // seq
    if seqs % dp:
        raise Skip(f"{seqs} sequences do not split over DP {dp}", out)
    per_replica = seqs // dp
    mbs = _num(row, "microbatch", int)
    if not mbs:
        mbs = 1 if pp > 1 else per_replica
        out.append(("microbatch", mbs, "blank: one sequence under a pipeline" if pp > 1
                    else "blank: the replica's whole batch, no accumulation"))
    if per_replica % mbs:
        raise Skip(f"micro-batch {mbs} does not divide {per_replica} sequences per replica",
                   out)
    return tokens, per_replica // mbs
