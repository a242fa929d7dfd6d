"""What a run reads and writes: the corpus and its global batches, tokenizers, data checks
before launch, checkpoints, the one-process model from a checkpoint, the Hugging Face
export."""
