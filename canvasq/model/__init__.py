"""The DiffusionGemma forward we own.

- `loading`: checkpoints → `ModelBundle` (lead);
- `shapes`: named shapes (`random:26b-a4b`);
- `arena`: `KVArena`, the per-layer K/V buffers with absolute positions per entry;
- `runtime`: `Runtime` (weights taken from the HF model), `Window`, `DecodeOutput`;
- `experts`: torch twins of the routed experts (per-expert loop, grouped GEMMs);
- `decode_graph`: `DecodeGraph` (CUDA-graph replay over row / context buckets) and `pad_window`;
- `graph`: `GraphRunner` (the decoders' cache of graphs over one persistent arena per runtime), which
  re-exports `decode_graph`'s names.

Flow: Job (core, CPU) → DecodeBatch (worker) → the windows of one forward (`model.runtime.Window`).
Nothing is imported here so that `canvasq.model.loading` stays cheap to import.
"""
