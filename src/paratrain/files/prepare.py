"""Before launch: the tokenizer and records are checked, a ``bpe:N`` tokenizer trained
and the token ids cached once here, and the model's vocabulary set to the tokenizer's.

Workers then find everything in the cache (:func:`paratrain.files.corpus.prepare`), so N
processes never train N tokenizers, and a bad ``--tokenizer`` or a missing text field
is one ``error:`` line from the launcher, not one per rank. No torch here.

:func:`claim_checkpoint_dir`: the checkpoint directory is this run's alone (locked for
the run's life, :mod:`paratrain.files.checkpoint.lock`), and a fresh run never writes
into one that holds another run's steps (docs/faults.md, "Fault table").
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from paratrain.config import ModelConfig, TrainConfig, load_toml


def settle_vocab(mcfg: ModelConfig, tcfg: TrainConfig, config: str | None,
                 vocab_from: str | None = None) -> ModelConfig:
    """``mcfg`` with ``vocab_size`` = the tokenizer's (a larger ``vocab_size`` set in the
    TOML is kept: unused rows; a smaller one is refused). ``vocab_from``: the file that
    fixed ``vocab_size`` (``--init-from``'s config.json), under the same rule."""
    from paratrain.files.corpus import data_files, prepare  # numpy: not at CLI start-up
    from paratrain.files.tokenizer import BYTES_VOCAB, parse_spec

    kind, _ = parse_spec(tcfg.tokenizer)
    if vocab_from is not None and kind == "bytes":
        _check_fixed_vocab(mcfg, tcfg, BYTES_VOCAB, vocab_from)
    if not tcfg.text_field:
        raise ValueError("--text-field '' is empty; pass the records' text field, e.g. "
                         "--text-field text")
    records = tcfg.data is not None and data_files(tcfg.data)[1]
    if kind == "bytes" and not records:
        return mcfg  # bytes of text files: nothing to prepare (as before tokenizers)
    _, _, tok, _ = prepare(tcfg.data, tcfg.val_fraction, tcfg.tokenizer, tcfg.text_field)
    if kind == "bytes":
        return mcfg
    if vocab_from is not None:
        _check_fixed_vocab(mcfg, tcfg, tok.vocab_size, vocab_from)
        return mcfg
    set_in_toml = config is not None and "vocab_size" in load_toml(config).get("model", {})
    if set_in_toml and mcfg.vocab_size < tok.vocab_size:
        raise ValueError(f"vocab_size = {mcfg.vocab_size} in {config} is smaller than the "
                         f"{tok.vocab_size} tokens of --tokenizer {tcfg.tokenizer}; remove "
                         "vocab_size from the TOML (it follows the tokenizer)")
    return mcfg if set_in_toml else mcfg.replace(vocab_size=tok.vocab_size)


def claim_checkpoint_dir(checkpoint_dir: str | None, resume: str | None,
                         checkpoint_every: int, lead: bool):
    """A context holding ``--checkpoint-dir``'s lock (``lead``: the process that holds
    it for the run); refuses ``--checkpoint-every`` without a directory, and a fresh run
    (``resume`` None) into a directory that holds anything but the lock file. The lock
    is taken first, so a concurrent run is named as such rather than as leftovers."""
    from paratrain.files.checkpoint.lock import LOCK_FILE, acquire

    if checkpoint_dir is None:
        if checkpoint_every:
            raise ValueError(f"--checkpoint-every {checkpoint_every} saves nothing without "
                             "--checkpoint-dir; add --checkpoint-dir DIR, or drop "
                             "--checkpoint-every")
        return contextlib.nullcontext()
    if not lead:
        return contextlib.nullcontext()
    held = acquire(checkpoint_dir)
    if resume is None:
        found = sorted(p.name for p in Path(checkpoint_dir).iterdir() if p.name != LOCK_FILE)
        if found:
            held.release()
            shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
            raise ValueError(f"--checkpoint-dir {checkpoint_dir!r} already holds files "
                             f"({shown}: another run's checkpoints?); pass a new or empty "
                             "directory, or add --resume to continue the run they belong to")
    return held


def _check_fixed_vocab(mcfg: ModelConfig, tcfg: TrainConfig, tokens: int,
                       vocab_from: str) -> None:
    """The tokenizer fits the vocabulary ``vocab_from`` fixed (see :func:`settle_vocab`)."""
    own = Path(tcfg.tokenizer).is_file() and \
        Path(tcfg.tokenizer).parent.resolve() == Path(vocab_from).parent.resolve()
    if tokens == mcfg.vocab_size or (own and tokens < mcfg.vocab_size):
        return
    raise ValueError(f"--tokenizer {tcfg.tokenizer} has {tokens} tokens but vocab_size="
                     f"{mcfg.vocab_size} in {vocab_from}; pass the model's own tokenizer.json "
                     "with --tokenizer PATH")
