"""One process, the whole model: any checkpoint as a plain, unsharded state_dict.

What ``paratrain generate`` / ``export`` build on: the names are those of
:class:`paratrain.model.Decoder` (``tok_emb.weight``, ``blocks.0.attn.wq.weight``, ...),
every tensor full size, on the CPU, in the optimizer's master dtype (FP32 for a
``--dtype bfloat16`` run). No process group is needed, whatever layout wrote the
checkpoint (format 2: DCP pieces; format 1, the older per-rank pickles: one process,
dp, ZeRO 1-3).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch



def load_full_model(root: str | Path, step: int | None = None
                    ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, state_dict) of the checkpoint at ``step`` (default: the newest intact one)
    under ``root``. ``meta`` is the step's meta.json (``model`` holds the ModelConfig
    fields, ``step`` the step). Raises ValueError (one line) when there is none."""
    from torch.distributed.checkpoint.api import CheckpointException

    from paratrain.files import checkpoint

    root = Path(root)
    candidates = checkpoint.steps(root) if step is None else [step]
    if not candidates:
        raise ValueError(f"no checkpoint found in {str(root)!r}; train with "
                         "--checkpoint-dir first")
    why = "no step directory"
    for s in candidates:
        d = checkpoint.step_dir(root, s)
        try:
            meta = checkpoint._meta(root, s)
            if meta is None:
                raise ValueError("meta.json is missing or unreadable")
            if meta.get("format", 1) == 1:
                return meta, _assemble(d, meta)
            bad = checkpoint.verify_files(d, meta, range(len(meta["files"])))
            if bad:
                raise ValueError(bad[0])
            from paratrain.files.checkpoint.sharded import load_full

            sd = load_full(d)
            if meta["model"].get("tie_embeddings"):
                sd["head.weight"] = sd["tok_emb.weight"]
            return meta, sd
        except (OSError, ValueError, RuntimeError, KeyError, CheckpointException) as e:
            why = f"{d}: {e}".splitlines()[0]
    raise ValueError(f"no intact checkpoint in {str(root)!r} ({why})")


def _rank_states(d: Path, meta: dict) -> list[dict]:
    import torch

    from paratrain.files.checkpoint import _sha256

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
