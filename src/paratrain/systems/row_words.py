"""What a runs-table row's free-text cells say about its layout: the ZeRO stage its
sharding cell names (:func:`zero_stage`), the recomputation its recompute cell names
(:func:`recompute_mode`, :func:`recompute_stated`) and the numbers its precision cell
names (:func:`fp16_said`, :func:`eight_bit_said`, :func:`four_bit_said`).

A published run names these as its framework does: DeepSpeed's "ZeRO stage 2" or
``zero_stage: 3``, PyTorch FSDP's ``FULL_SHARD`` / ``SHARD_GRAD_OP`` / ``HYBRID_SHARD`` /
``NO_SHARD``, Megatron's "distributed optimizer"; "activation checkpointing", "AC",
"SAC" (torchtitan's selective activation checkpointing), or a flag's ``true`` / ``false``.
A cell that says nothing the model can read (blank, "not stated") is told apart from one
that says "none", so the row's reader infers the first from memory
(:func:`paratrain.systems.runs.row_to_case`).
"""

from __future__ import annotations

import re

from paratrain.systems.recompute_modules import modules_said

_STAGE = re.compile(r"zero(?:\+\+)?[\s_\-]*(?:stage[\s_\-=:]*)?([0-3])(?![0-9])")
# a cell that is the stage alone, as a zero_stage column holds it: "2", "stage 2"
_BARE_STAGE = re.compile(r"(?:stage[\s_\-=:]*)?([0-3])")


def zero_stage(text: str) -> int:
    """0-3 from a sharding cell: ZeRO-3, FSDP (resharding after forward: FULL_SHARD, or
    HYBRID_SHARD within a group) and ZeRO++'s hpZ shard the parameters; ZeRO-2 and FSDP's
    SHARD_GRAD_OP (not resharded) the gradients; ZeRO-1 and Megatron's distributed
    optimizer the optimizer states; DDP, NO_SHARD and silence nothing."""
    t = text.lower()
    if "no_shard" in t or "no shard" in t:
        return 0
    if "shard_grad_op" in t or "shard grad op" in t:
        return 2
    said = _STAGE.search(t) or _BARE_STAGE.fullmatch(t.strip())
    stage = int(said.group(1)) if said else None
    if stage == 3 or "2d sharding" in t or "hsdp" in t or "zero++" in t or (
            "fsdp" in t and "not resharded" not in t) or re.search(r"(full|hybrid)[_ ]shard", t):
        return 3
    if stage == 2 or "fsdp" in t:
        return 2
    return 1 if stage == 1 or re.search(r"dist(?:ributed)?[\s_-]*opt", t) else 0


def zero_stated(text: str) -> bool:
    """Whether a sharding cell says its stage, none included ("none", "DDP", FSDP's
    ``NO_SHARD``); otherwise the engine's own default applies."""
    t = text.lower()
    return zero_stage(t) > 0 or t.strip().startswith("none") or "no_shard" in t or \
        "no shard" in t or re.search(r"\bddp\b", t) is not None or \
        _BARE_STAGE.fullmatch(t.strip()) is not None


_OFF = ("false", "no", "off", "0", "disabled", "n")
_ON = ("true", "yes", "on", "1", "enabled", "y", "ac", "full ac")


def recompute_mode(text: str) -> str:
    """none, selective or full from a recompute cell ("none" where it says nothing, which
    :func:`recompute_stated` tells apart). A selective recomputation whose module list
    names the MLP or the MoE layer (Megatron-Core's recompute modules ``mlp``, ``moe``)
    holds most of the block's activations again: its memory is counted as full (its
    time, module by module: ``Case.rerun``)."""
    t = text.lower().strip()
    if not t or t.startswith("none") or t.startswith("no ") or t in _OFF:
        return "none"
    if "selective" in t or re.search(r"\bsac\b", t):
        return "full" if {"mlp", "moe"} & set(modules_said(t)) else "selective"
    if t in _ON or any(k in t for k in ("full", "checkpoint", "rematerial", "recomput")):
        return "full"
    # JAX's remat (not a MaxText policy that saves most: "minimal", "save_..."), "ckpt"
    if re.search(r"\bremat\b|\bckpt\b", t) and not re.search(r"minimal|save", t):
        return "full"
    return "none"


_SHARE = (re.compile(r"(\d+(?:\.\d+)?)\s*%"),
          re.compile(r"(\d+)\s*(?:of|/)\s*(\d+)\s*(?:layers|blocks)"))


def recompute_share_said(text: str) -> float:
    """The share of blocks a full-recompute cell says it reruns: "full on 50% of the
    blocks", "activation checkpointing on 8 of 32 layers"; 1 where it names none."""
    t = text.lower()
    if recompute_mode(t) != "full":
        return 1.0
    pct, frac = (p.search(t) for p in _SHARE)
    share = float(pct.group(1)) / 100 if pct else (
        int(frac.group(1)) / int(frac.group(2)) if frac and int(frac.group(2)) else 1.0)
    return share if 0 < share <= 1 else 1.0


def recompute_stated(text: str) -> bool:
    """Whether a recompute cell says anything (not blank, "not stated", ...)."""
    t = text.lower().strip()
    return (t.startswith("none") or t.startswith("no ") or t in _OFF
            or recompute_mode(t) != "none")


# 8-bit linear layers as sources write them: Transformer Engine's "FP8" (E4M3 / E5M2
# operands, "fp8-hybrid", MXFP8), torchao's and torchtitan's "float8" (a converter of
# that name), "8-bit floating point", MaxText's AQT "int8"; not an "8-bit Adam", which is
# the optimizer's states
_EIGHT_BIT = re.compile(r"fp8|float[\s_-]?8|e4m3|e5m2|int8|8[\s-]?bit float")
_FOUR_BIT = re.compile(r"fp4|float[\s_-]?4|int4|4[\s-]?bit float")


# 16-bit floats of the fp16 kind: "fp16", "float16" (not bfloat16), "half precision"
_FP16 = re.compile(r"fp16|(?<![a-z])float[\s_-]?16|half[\s-]?precision")


def _says(pattern: re.Pattern, text: str | None) -> bool:
    return bool(pattern.search((text or "").lower()))


def _first(words: tuple, text: str | None) -> str | None:
    """The value of the first (word, value) pair whose word the cell contains."""
    low = (text or "").strip().lower()
    return next((value for word, value in words if word in low), None)


def fp16_said(text: str) -> bool:
    """Whether a precision cell says fp16 (not bf16): an fp16 run's era and optimizer."""
    return _says(_FP16, text)


def eight_bit_said(text: str) -> bool:
    """Whether a precision cell says the linear layers multiply in 8 bits."""
    return _says(_EIGHT_BIT, text)


def four_bit_said(text: str) -> bool:
    """Whether a precision cell says 4-bit GEMMs (NVFP4, MXFP4, int4)."""
    return _says(_FOUR_BIT, text)


# a TFLOP/s figure that counts the recomputed forward too: "hardware", "HFU", "incl.
# recompute", "including activation recomputation" (not "excluding recompute")
_HARDWARE = re.compile(r"hardware|\bhfu\b|\bincl\w*\.?\s+(?:the\s+)?(?:activation\s+)?recomput")


def hardware_flops_said(text: str) -> bool:
    """Whether a ``tflops_kind`` cell says the figure counts hardware FLOPs."""
    return _says(_HARDWARE, text)


# pipeline schedules as papers and frameworks name them -> paratrain.plan.SCHEDULES
# (first match wins): Megatron's "interleaved 1F1B" / virtual pipeline, torchtitan's
# "Interleaved1F1B" and "LoopedBFS" (virtual stages too), Qi et al.'s zero-bubble
# schedules, DeepSeek's DualPipe (its V-shaped variant the one paratrain runs), GPipe's
# fill-drain, PipeDream-Flush (1F1B)
_SCHEDULE_WORDS = (("zb-v", "zb-v"), ("zbv", "zb-v"), ("zero bubble v", "zb-v"),
                   ("zero-bubble v", "zb-v"), ("dualpipe", "dualpipev"),
                   ("zb-h1", "zb-h1"), ("zb h1", "zb-h1"), ("zbh1", "zb-h1"),
                   ("zero bubble", "zb-h1"), ("zero-bubble", "zb-h1"),
                   ("interleav", "interleaved"), ("virtual", "interleaved"),
                   ("vpp", "interleaved"), ("looped", "interleaved"),
                   ("breadth", "interleaved"), ("gpipe", "gpipe"), ("fill-drain", "gpipe"),
                   ("fill drain", "gpipe"), ("1f1b", "1f1b"), ("pipedream", "1f1b"),
                   ("one-forward-one-backward", "1f1b"))


def schedule_said(text: str) -> str | None:
    """The pipeline schedule a ``schedule`` cell names (:data:`paratrain.plan.SCHEDULES`),
    or None when it names none of them."""
    return _first(_SCHEDULE_WORDS, text)


# a metric cell's words -> the figure it names (runs.py's keys; first match wins)
_METRIC_WORDS = (("hfu", "hfu"), ("mfu", "mfu"), ("tflop", "tflops"), ("step", "step"),
                 ("token", "tokens"), ("tok/s", "tokens"), ("throughput", "tokens"),
                 ("tps", "tokens"))


def metric_said(text: str) -> str | None:
    """The reported figure a ``metric`` cell names ("MFU", "tokens/s/GPU", "TFLOP/s per
    GPU", "step time", ...), or None when it names none."""
    return _first(_METRIC_WORDS, text)


def mlp_said(text: str) -> str | None:
    """The MLP a ``mlp`` cell names, by what the step model prices (its matrices): a gated
    one ("SwiGLU", "GeGLU", "ReGLU", "gated GELU": gate and up, then down) is "swiglu",
    any other activation ("GELU", "ReLU", "squared ReLU": up, then down) "gelu"; None
    when it is blank."""
    low = (text or "").strip().lower()
    if not low:
        return None
    return "swiglu" if "glu" in low or "gated" in low else "gelu"


_TIED = re.compile(r"(yes|y\b|true|1\b|tied|shared)")


def tied_said(text: str) -> bool | None:
    """Whether a ``tied`` cell says the input and output embeddings are shared ("yes",
    "true", "tied", "shared (input and output)"; not "untied", "no"); None when blank."""
    low = (text or "").strip().lower()
    return bool(_TIED.match(low)) if low else None
