"""The cost model's base: every formula the runtime, the systems model and the plots share.

Pure Python, no torch, at the bottom of the import order (it imports only the settings
values, :mod:`paratrain.config` and :mod:`paratrain.plan`). One home per formula:

- model shapes, parameter counts, FLOPs per token: :mod:`.shapes` (with the catalogue of
  published models, :mod:`.catalogue`, ``data/models.toml``), hardware: :mod:`.hardware`;
- the pipeline: the stage split (:mod:`.stages`), the schedule as data, its simulator and
  its closed-form bubble (:mod:`.schedule`);
- collectives: wire bytes and alpha-beta time (:mod:`.collectives`);
- the mesh: rank order and each rank's parameters (:mod:`.ranks`), the dp reducers'
  flat buffers (:mod:`.buffers`), model-state and dp bytes per rank (:mod:`.dp_bytes`),
  tensor-parallel bytes per block (:mod:`.tp_bytes`), context-parallel pieces and bytes
  (:mod:`.cp_bytes`), where groups sit on a cluster (:mod:`.groups`); :mod:`.layout`
  gathers the per-rank API;
- memory: precision recipes and ZeRO states (:mod:`.memory`), activations
  (:mod:`.activations`; paratrain's MoE block: :mod:`.moe_activations`).
"""
