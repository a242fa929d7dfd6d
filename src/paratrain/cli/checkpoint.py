"""`paratrain generate` and `paratrain export`: a checkpoint back in one process, as
text or as a Hugging Face folder. No torch at import time (like every command module)."""

from __future__ import annotations

from typing import Annotated

import typer

Opt = typer.Option


def register(app: typer.Typer) -> None:
    @app.command()
    def generate(
        prompt: Annotated[str, Opt(help="Text to continue.")],
        checkpoint: Annotated[str | None, Opt(help="A training run's --checkpoint-dir.")
                              ] = None,
        init_from: Annotated[str | None, Opt(
            help="Or a Hugging Face folder (Llama, Mistral, Qwen2/3, Mixtral, "
                 "Qwen2/3-MoE, Phi-3/4), read as train --init-from reads it.")] = None,
        max_new_tokens: Annotated[int, Opt(help="Tokens to add.")] = 200,
        temperature: Annotated[float, Opt(
            help="0 = greedy (argmax); T > 0 samples from softmax(logits / T).")] = 0.0,
        top_k: Annotated[int | None, Opt(
            help="Sample among the k likeliest tokens (with --temperature > 0).")] = None,
        top_p: Annotated[float, Opt(
            help="Sample among the fewest tokens whose probabilities reach P (nucleus; "
                 "with --temperature > 0; 1 = all).")] = 1.0,
        seed: Annotated[int, Opt(help="Seed of the sampler (with --temperature > 0).")] = 0,
    ) -> None:
        """Continue --prompt with text sampled from a checkpoint (any layout) or a
        Hugging Face folder."""
        from paratrain.files.inference import eos_ids, load, load_hf
        from paratrain.run.generate import check_args, sample

        check_args(max_new_tokens, temperature, top_k, top_p)
        if (checkpoint is None) == (init_from is None):
            raise ValueError("pass --checkpoint DIR (a training run's) or --init-from HF_DIR "
                             "(a Hugging Face folder): one of the two")
        run = load(checkpoint) if checkpoint else load_hf(init_from, prompt, max_new_tokens)
        eos = eos_ids(init_from or checkpoint)  # a folder's (kept by a run from one)
        ids, new = sample(run, prompt, max_new_tokens, temperature, top_k, seed, top_p, eos)
        print(run.tokenizer.decode(ids + new), flush=True)

    @app.command()
    def export(
        checkpoint: Annotated[str, Opt(help="A training run's --checkpoint-dir.")],
        out: Annotated[str, Opt(help="Folder for config.json, model.safetensors, tokenizer."
                                )],
    ) -> None:
        """Write a checkpoint as a Hugging Face folder (LlamaForCausalLM; Qwen2, Qwen3,
        Mixtral, Qwen2-MoE or Qwen3-MoE for their attention or experts)."""
        from paratrain.files.export import check_out
        from paratrain.files.export import export as write
        from paratrain.files.inference import eos_ids, load

        check_out(out)  # before anything is read
        run = load(checkpoint)
        files = write(run, out, eos_ids(checkpoint))  # a folder's, kept by a run from one
        print(f"wrote step {run.meta['step']} of {checkpoint}: "
              + ", ".join(str(f) for f in files), flush=True)
