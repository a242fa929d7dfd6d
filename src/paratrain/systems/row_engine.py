"""Which engine ran a runs-table row, and why.

The engine decides what a step hides (TP collectives under GEMMs, ZeRO-3 gathers under
compute: :mod:`paratrain.systems.overlap`), so a wrong guess moves a prediction by a
factor: DeepSpeed's ZeRO-3 exposes gathers that Megatron-LM never issues. A row says
which engine ran it in several places, read in this order, the first that names one
winning:

1. ``engine`` (the stack that ran it): a filled cell decides; an engine we model by its
   name, any other stack (Meta's Llama 3 stack, an unpublished one) as Megatron-LM's
   defaults, since the row's sharding words then name a technique, not the stack; except
   on a TPU, where any stack we do not name (a JAX trainer, PyTorch/XLA) is compiled by
   XLA, so the accelerator decides;
2. ``accelerator`` (a TPU runs XLA, whatever its sharding is called: MaxText's "FSDP" is
   XLA's, not PyTorch's);
3. ``zero_or_fsdp`` (how the states were sharded: "FSDP" is PyTorch's, "ZeRO" DeepSpeed's
   name for stage 3, "distributed optimizer" Megatron's; ZeRO-1/2 is everyone's);
4. ``precision`` (Composer's precision names ``amp_bf16`` / ``amp_fp16``);
5. ``model`` (catalogue text such as "Llama 3.1 70B (NeMo)");
6. ``source`` (a repository such as mosaicml/llm-foundry or NVIDIA/dgxc-benchmarking).

In each column a word that names a stack (:data:`paratrain.systems.overlap._KEYWORDS`)
beats a word that names a technique (:data:`TECHNIQUE_WORDS`), so "FSDP FULL_SHARD
(ZeRO-3)" is fsdp. Nothing naming one: Megatron-LM's defaults, said so. Free-text
``notes`` and the row's ``id`` (a label) are never read. Each answer carries its reason
(column, its text and the word), which ``paratrain validate --explain`` prints and the
JSON record keeps.
"""

from __future__ import annotations

from dataclasses import replace

from paratrain.systems.gemm import family
from paratrain.systems.graph_scopes import SCOPES, scopes_said, unknown_scopes
from paratrain.systems.overlap import DEFAULT_ENGINE, ENGINES, Engine, engine, named_engine
from paratrain.systems.row_words import eight_bit_said, fp16_said

COLUMNS = ("engine", "accelerator", "zero_or_fsdp", "precision", "model", "source")
# words that name a technique, not a stack, per column -> the engine that calls it so
TECHNIQUE_WORDS = {
    "zero_or_fsdp": (("distributed optimizer", "megatron"), ("zero-3", "deepspeed"),
                     ("zero stage 3", "deepspeed")),
    "precision": (("amp_", "fsdp"),),
}


def _in_column(col: str, text: str) -> tuple[str, str] | None:
    found = named_engine(text)
    if found:
        return found
    low = text.lower()
    return next(((eng, w) for w, eng in TECHNIQUE_WORDS.get(col, ()) if w in low), None)


def row_engine(row: dict) -> tuple[str, str]:
    """(engine name in :data:`~paratrain.systems.overlap.ENGINES`, why) for one row."""
    for col in COLUMNS:
        text = (row.get(col) or "").strip()
        found = _in_column(col, text) if text else None
        if found:
            return found[0], f"{col} {text!r} says {found[1]!r}"
        if text and col == "engine":
            tpu = _in_column("accelerator", (row.get("accelerator") or "").strip())
            if tpu and tpu[0] == "xla":
                return tpu[0], (f"engine {text!r} is none we model, on accelerator "
                                f"{row['accelerator'].strip()!r}, which says {tpu[1]!r}: "
                                "XLA compiles whatever stack runs on a TPU")
            return DEFAULT_ENGINE, (f"engine {text!r} is none we model ({', '.join(ENGINES)})"
                                    f": {DEFAULT_ENGINE} (Megatron-LM's defaults)")
    return DEFAULT_ENGINE, (f"no column of {', '.join(COLUMNS)} names an engine: "
                            f"{DEFAULT_ENGINE} (Megatron-LM's defaults)")


# words of a row's ``engine`` column that say how its engine ran, not which engine it is:
# (word, the Engine fields it sets, why); the engine column only, never ``notes``
ENGINE_OPTIONS = (
    ("torch.compile", (("fusion", 1.0),),
     "the compiler fuses the element-wise chains (overlap.Engine.fusion 1)"),
    ("vanilla tp", (("tp", 0.0),), "tensor-parallel collectives block, no async TP"),
    ("no async tp", (("tp", 0.0),), "tensor-parallel collectives block"),
    # PyTorch's SDPA picks its flash backend (FlashAttention-2 class) before cuDNN's on
    # Hopper and Blackwell until torch 2.11 (pytorch/pytorch#138522 made cuDNN opt-in
    # after 2.5); a cell saying both ("SDPA, cuDNN backend") means cuDNN: it comes later
    ("sdpa", (("attention", "flash"),),
     "PyTorch's SDPA, whose default backend is FlashAttention-2 class "
     "(overlap.Engine.attention flash)"),
    ("flashattention 1", (("attention", "flash1"),),
     "the first FlashAttention, at half FlashAttention-2's rate "
     "(overlap.Engine.attention flash1, step_params.FLASH1_SPEED)"),
    ("cudnn", (("attention", "flash3"),),
     "cuDNN's fused attention, the chip's native kernel (overlap.Engine.attention flash3)"),
    *((word.lower(), (("dispatcher", "flex"),),
       f"MoE tokens cross nodes once per node ({word}; overlap.Engine.dispatcher flex, "
       "moe_step.node_dedup)") for word in ("DeepEP", "HybridEP")),
    ("full-iteration cuda graph", (("graphed", True),),
     "the step's kernels replay from a CUDA graph, none launched from the host "
     "(overlap.Engine.graphed)"),
)


def engine_options(row: dict) -> tuple[tuple[tuple[str, object], ...], str]:
    """(Engine fields to replace, why) from the option words of a row's ``engine`` cell
    (:data:`ENGINE_OPTIONS`): torchtitan's benchmarks run with and without torch.compile,
    with and without async TP, and the same engine prices both only if the row says
    which."""
    low = (row.get("engine") or "").lower()
    hits = [(w, fields, why) for w, fields, why in ENGINE_OPTIONS if w in low]
    scopes = scopes_said(low)
    if scopes:
        hits.append((f"cuda graph scope {' '.join(scopes)}", (("graph_scopes", scopes),),
                     "these parts of each layer replay from CUDA graphs, the rest "
                     "launched from the host (overlap.Engine.graph_scopes)"))
    fields = tuple(f for _, fs, _ in hits for f in fs)
    return fields, "".join(f"; {w!r}: {why}" for w, _, why in hits)


def engine_as_said(text: str) -> Engine:
    """The engine ``text`` names, with the options its words set (:func:`engine_options`):
    `paratrain plan --engine "torchtitan, torch.compile"` prices as that engine cell; a
    CUDA graph scope it does not know is a ValueError naming the scopes."""
    bad = unknown_scopes(text)
    if bad:
        raise ValueError(f"CUDA graph scope {' '.join(bad)!r} is unknown; name some of "
                         f"{', '.join(SCOPES)}, e.g. --engine \"nemo, CUDA graph scope "
                         "attn moe_router\"")
    return replace(engine(text), **dict(engine_options({"engine": text})[0]))


def precision_says(case, word: str) -> bool:
    """Whether a case's ``precision`` column names ``word`` (fp16, fp8, ...)."""
    return word in (getattr(case, "precision", "") or "").lower()


# the chip families that were trained on before FlashAttention (2022) was adopted; on
# every later one (Hopper, Blackwell, MI300 on, TPUs, Gaudi) no stack writes the s x s
# scores out: DeepSpeed and Megatron-DeepSpeed run flash-attn or PyTorch's SDPA there
PRE_FLASH_FAMILIES = ("v100", "a100", "mi250x")


def pre_flash(case) -> bool:
    """Whether a case's chip predates FlashAttention's adoption
    (:data:`PRE_FLASH_FAMILIES`): where eager attention is an era's, not a choice."""
    return family(case.hw.name) in PRE_FLASH_FAMILIES


def case_attention(case) -> str | None:
    """The attention kernel a case runs when it is not its engine's (None): the kernel the
    row names, always (its engine options: "FlashAttention 1" on an fp16 A100 run is
    FlashAttention 1); else eager for a run in fp16 on a chip from before
    FlashAttention's adoption in 2022-23 (the table's fp16 rows are all of that era);
    FlashAttention-2 class ("flash") where the engine's default is eager (DeepSpeed's,
    :data:`paratrain.systems.overlap.ENGINES`) but the chip came after it
    (:func:`pre_flash`)."""
    if "attention" in dict(getattr(case, "engine_options", ())):
        return None  # the row's own words
    if pre_flash(case):
        return "eager" if fp16_said(getattr(case, "precision", "")) else None
    return "flash" if case_engine(case).attention == "eager" else None


def case_kernel(case) -> str:
    """The attention kernel a case runs: :func:`case_attention`'s, else its engine's
    (:func:`case_engine`)."""
    return case_attention(case) or case_engine(case).attention


def eight_bit(case) -> bool:
    """Whether a case's linear layers multiply in 8 bits: FP8 on GPUs, int8 on TPUs
    (MaxText's AQT ``quantization: int8``), priced alike at the chip's 8-bit peak
    (``Hardware.peak_flops_fp8``) with its casts (:mod:`paratrain.systems.layer_cost`)."""
    return eight_bit_said(getattr(case, "precision", "") or "")


def fp8_scaling(case) -> bool | str:
    """How a case's linear layers run, for the step model's ``fp8`` argument: False in 16
    bits; torchao's row-scaled recipes by name when the ``precision`` cell says
    "rowwise" ("rowwise_with_gw_hp" when it adds that the weight gradient stays in
    bf16, torchao's rowwise_with_gw_hp); else True, per-tensor scaling (and MXFP8's
    hardware block scales), priced alike (:data:`paratrain.systems.layer_cost.
    FP8_RECIPES`)."""
    if not eight_bit(case):
        return False
    if not precision_says(case, "rowwise"):
        return True
    gw_hp = precision_says(case, "weight gradient in bf16") or precision_says(case, "gw_hp")
    return "rowwise_with_gw_hp" if gw_hp else "rowwise"


def case_engine(case) -> Engine:
    """The engine a case was priced with (``Case.engine``, set by :func:`row_engine`,
    with the row's :func:`engine_options`); a run whose ``precision`` says fp16 has no
    fp32 gradient copies to add each micro-batch into (``Engine.hp_grad_bytes``:
    DeepSpeed's BF16 optimizer's)."""
    eng = replace(engine(getattr(case, "engine", None)),
                  **dict(getattr(case, "engine_options", ())))
    if fp16_said(getattr(case, "precision", "")):
        return replace(eng, hp_grad_bytes=0.0)
    return eng
