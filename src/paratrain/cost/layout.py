"""What every rank holds and sends, counted exactly, without torch: the one home of the
runtime's per-rank layout (:mod:`paratrain.parallel.mesh_engine`).

The runtime builds its layout from tensors; the prediction (:mod:`paratrain.predict`)
and the tests count it from the configs here, and the runtime calls the pieces it can
(:func:`vocab_range` in :mod:`paratrain.parallel.tensor`, :func:`pack_groups` in
:func:`paratrain.parallel.ddp.pack`), so the two cannot drift apart.

- **Coordinates** (:mod:`.ranks`: :func:`coords`, :func:`mesh_coords`): rank =
  ((pp_i x dp + dp_i) x cp + cp_i) x tp + tp_i, tp innermost, then cp, dp, pp
  (:mod:`paratrain.parallel.mesh`).
- **Chunks** (:func:`chunk_param_sizes`): pipeline rank i keeps virtual stages
  k = c x pp + i, c < v (v = ``virtual_stages`` when interleaved, else 1; V-shaped
  schedules: k = i and 2 pp - 1 - i, :func:`paratrain.cost.schedule.stage_of`), blocks from
  :func:`paratrain.cost.stages.split_layers`; without a pipeline one chunk, the whole
  model. Parameters in registration order: tok_emb (first stage), per block
  [attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down] (Qwen2's bias after each
  of wq, wk, wv; Qwen3's q_norm, k_norm after wo), norm and head (last);
  a tied head (pp = 1 only) is the embedding's parameter, counted once. An MoE block's
  MLP is [router, this ep rank's E/ep experts x (gate, up, down), shared (gate, up,
  down)], not tp-sharded (:func:`block_param_sizes`; 1/etp of each expert matrix
  with ``--etp``); with ep or etp > 1 a rank has two reducers, dense over dp and
  experts over the fold's edp ranks (:func:`reducers`, :class:`.ranks.Fold`).
- **Tensor shards**: heads and d_ff split t ways; vocabulary rows ceil(V/t) per rank,
  the last rank fewer (:func:`vocab_range`); norm gains replicated.
- **The dp reducer** (:mod:`.buffers`: :func:`strategy` names the one
  :func:`paratrain.parallel.data_axis.data_axis` builds): flat buffers per chunk (gradient
  buckets of at most ``bucket_mb`` MiB packed greedily in reverse registration order,
  :func:`bucket_sizes`; or FSDP units, :func:`fsdp_unit_sizes`), each padded to a
  multiple of dp; rank r owns chunk r. Under HSDP (``dp_replicate`` R) chunks are
  cut over one replica's dp / R ranks (:func:`shard_group`, padding still to dp) and
  each owned chunk is all-reduced over the R replicas once per step
  (:func:`dp_replicate_calls`). Their bytes at rest and on the wire: :mod:`.dp_bytes`
  (per sub-axis: :func:`dp_wire_bytes_by_axis`).
- **Context parallelism** (:mod:`.cp_bytes`: :func:`cp_chunks`, :func:`ring_blocks`,
  :func:`cp_wire_bytes`): which sequence pieces a cp rank holds, which attention blocks
  it computes at each ring step, and the bytes it sends (:mod:`paratrain.parallel.context`).
"""

from __future__ import annotations

from paratrain.cost.buffers import (  # noqa: F401 - the package's API
    bucket_sizes,
    dp_flats,
    dp_kind,
    fsdp_unit_sizes,
    owned,
    pack_groups,
    pad,
    reducer_plan,
    shard_group,
    strategy,
    topk_keep,
)
from paratrain.cost.cp_bytes import (  # noqa: F401 - the package's API
    _kind,
    attention_pairs_per_rank,
    contiguous_blocks,
    cp_bytes_per_sequence_layer,
    cp_chunks,
    cp_positions,
    cp_wire_bytes,
    ring_blocks,
)
from paratrain.cost.dp_bytes import (  # noqa: F401 - the package's API
    _state_bytes,
    dp_calls,
    dp_payload_bytes,
    dp_replicate_calls,
    dp_wire_bytes,
    dp_wire_bytes_by_axis,
    dp_wire_factor,
    state_bytes,
    zero_wire_factor,
)
from paratrain.cost.ranks import (  # noqa: F401 - the package's API
    ELEMENT_BYTES,
    RankLayout,
    block_param_sizes,
    chunk_param_sizes,
    coords,
    elements,
    mesh_coords,
    rank_layout,
    rank_of,
    reducers,
    virtual_stages,
    vocab_range,
)
