"""`paratrain plan`'s FP8 options: --fp8 prices the linear layers' GEMMs in FP8 with the
step model (systems/layer_cost.py), --fp8-scaling names the scaling recipe."""

from __future__ import annotations


def fp8_options(fp8: bool, scaling: str | None, hw, reference: bool,
                precision: str) -> tuple[str, bool | str]:
    """(the memory's precision recipe, the step model's ``fp8`` argument)."""
    return check_fp8(fp8, hw, reference, precision), fp8_scaling(fp8, scaling)


def check_fp8(fp8: bool, hw, reference: bool, precision: str) -> str:
    """--fp8 is the step model's (systems/layer_cost.py), on a chip with an FP8 peak; the
    precision recipe it prices memory with (bf16-adam's states: fp8-adam)."""
    if fp8 and reference:
        raise ValueError("--fp8 prices FP8 GEMMs with the step model; drop --reference")
    if fp8 and not hw.peak_flops_fp8:
        raise ValueError(f"--fp8: {hw.name} has no FP8 peak in the catalogue (FP8 tensor "
                         "cores came with Hopper); drop --fp8 or pick e.g. --hardware h100")
    from paratrain.cost.memory import mixed_recipe

    return mixed_recipe(fp8) if precision == "bf16-adam" else precision


def fp8_scaling(fp8: bool, scaling: str | None) -> bool | str:
    """The step model's ``fp8`` argument: False, True (per-tensor scaling) or the
    --fp8-scaling recipe's name (``systems.layer_cost.FP8_RECIPES``)."""
    if scaling is None:
        return fp8
    if not fp8:
        raise ValueError(f"--fp8-scaling {scaling} is a recipe for FP8 GEMMs; add --fp8")
    from paratrain.systems.layer_cost import fp8_recipe_name

    try:
        return fp8_recipe_name(scaling)
    except ValueError as e:
        raise ValueError(f"--fp8-scaling: {e}") from None
