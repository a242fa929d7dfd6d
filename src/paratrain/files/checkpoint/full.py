"""One process, the whole model: any checkpoint as a plain, unsharded state_dict.

What ``paratrain generate`` / ``export`` build on: the names are those of
:class:`paratrain.model.Decoder` (``tok_emb.weight``, ``blocks.0.attn.wq.weight``, ...),
every tensor full size, on the CPU, in the optimizer's master dtype (FP32 for a
``--dtype bfloat16`` run). No process group is needed, whatever layout wrote the
checkpoint (format 2: DCP pieces; format 1, the older per-rank pickles: one process,
dp, ZeRO 1-3).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.files.checkpoint.verify import check_step, fallback_line

if TYPE_CHECKING:
    import torch



def load_full_model(root: str | Path, step: int | None = None
                    ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, state_dict) of the checkpoint at ``step`` (default: the newest intact one)
    under ``root``. ``meta`` is the step's meta.json (``model`` holds the ModelConfig
    fields, ``step`` the step). A step that is not intact is passed over with the one
    warning line ``train --resume`` prints; raises ValueError (one line) when none is."""
    from paratrain.files import checkpoint

    root = Path(root)
    candidates = checkpoint.steps(root) if step is None else [step]
    if not candidates:
        raise ValueError(f"no checkpoint found in {str(root)!r}; train with "
                         "--checkpoint-dir first")
    why = "no step directory"
    for i, s in enumerate(candidates):
        d = checkpoint.step_dir(root, s)
        loaded, why = _try_step(d)
        if loaded is not None:
            return loaded
        if step is None:
            nxt = f"step_{candidates[i + 1]:06d}" if i + 1 < len(candidates) else "nothing"
            print(fallback_line(d, why, nxt), file=sys.stderr, flush=True)
    raise ValueError(f"no intact checkpoint in {str(root)!r} ({d}: {why})")


def _try_step(d: Path) -> tuple[tuple[dict, dict] | None, str]:
    """((meta, state_dict), "") of step ``d``, or (None, why it is not intact)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from paratrain.files.checkpoint.safe_metadata import (
        UnsafeMetadata,
        read_failure,
        read_metadata,
    )
    from paratrain.files.checkpoint.sharded import load_full

    meta, why = check_step(d)
    if meta is None:
        return None, why
    try:
        if meta.get("format", 1) == 1:
            return (meta, _assemble(d, meta)), ""
        sd = load_full(d, read_metadata(d, meta["files"]))
    except CheckpointException as e:
        return None, read_failure(e)
    except UnsafeMetadata as e:
        return None, str(e)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if meta["model"].get("tie_embeddings"):
        sd["head.weight"] = sd["tok_emb.weight"]
    return (meta, sd), ""


def _rank_states(d: Path, meta: dict) -> list[dict]:
    import torch

    from paratrain.files.checkpoint.verify import sha256_file as _sha256

    out = []
    for name, digest in sorted(meta["files"].items(), key=lambda kv: int(kv[0][4:-3])):
        if _sha256(d / name) != digest:
            raise ValueError(f"{name} fails its sha256 check")
        out.append(torch.load(d / name, map_location="cpu", weights_only=True))
    return out


def _assemble(d: Path, meta: dict) -> dict:
    """Per-rank pickles (format 1) -> the plain model's state_dict."""
    import torch

    from paratrain.config import ModelConfig
    from paratrain.model import Decoder

    states = _rank_states(d, meta)
    plan = meta["plan"]
    if any(plan.get(k, 1) > 1 for k in ("tp", "pp", "ep")):
        raise ValueError("this checkpoint was written by a tp/pp/ep layout in the "
                         "per-rank format; it can only be resumed with the same layout")
    if "model" in states[0]:  # one process, or replicated parameters (ddp, ZeRO-1/2)
        sd = states[0]["model"]
        return {k.removeprefix("0."): v for k, v in sd.items()}
    # ZeRO-3: concatenate the ranks' flat shards of each unit, cut it into parameters
    from paratrain.parallel.fsdp import default_units
    from paratrain.parallel.pipeline.stage import build_chunks

    model = Decoder(ModelConfig(**meta["model"]))
    chunk = build_chunks(model, 1, 1, 0)[0]
    names = {id(p): n for n, p in chunk.named_parameters()}
    out, seen = {}, set()
    for u, unit in enumerate(default_units(chunk)):
        flat = torch.cat([st["shards"][u] for st in states])
        off = 0
        for m in unit:
            for q in m.parameters():
                if id(q) in seen:
                    continue
                seen.add(id(q))
                out[names[id(q)]] = flat[off:off + q.numel()].view(q.shape).clone()
                off += q.numel()
    if model.head.weight is model.tok_emb.weight:
        out["head.weight"] = out["tok_emb.weight"]
    return out
