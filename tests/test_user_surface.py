"""Guard the user surface: the README's quick start, the commands it names, and the
train command's flags (a flag added or removed by accident fails here)."""

from __future__ import annotations

import re
from pathlib import Path

from typer.main import get_command

from paratrain.cli import app

README = (Path(__file__).parents[1] / "README.md").read_text()

TRAIN_FLAGS = {
    "--attention", "--aux-loss-coef", "--bucket-mb", "--capacity-factor", "--ep",
    "--experts", "--moe-every", "--moe-ffn", "--shared-experts", "--top-k", "--z-loss-coef",
    "--checkpoint-dir", "--checkpoint-every", "--collectives",
    "--compress", "--config", "--context", "--cp", "--cp-algorithm", "--d-ff", "--d-model",
    "--data", "--dp", "--dtype",
    "--eval-every", "--global-batch", "--heads", "--kv-heads", "--layers", "--lr",
    "--micro-batches", "--nproc", "--overlap", "--pp", "--quiet", "--recompute",
    "--reduce-dtype", "--resume",
    "--run-dir", "--schedule", "--seed", "--simulate-workers", "--sp", "--steps",
    "--tensorboard", "--tie-embeddings", "--tp", "--virtual-stages", "--warmup-steps", "--zero",
    "--tokenizer", "--text-field",
    "--keep-checkpoints", "--max-restarts", "--nnodes", "--node-rank", "--rdzv-endpoint",
    "--timeout", "--grace",
    "resume_mode",  # hidden argument: the 'auto' of '--resume auto'
}


def _commands(group, prefix=()):
    for name, cmd in getattr(group, "commands", {}).items():
        yield (*prefix, name), cmd
        yield from _commands(cmd, (*prefix, name))


def test_quick_start_is_exactly_install_run_test():
    block = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmds = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert cmds == ['pip install -e ".[dev]"', "paratrain train", "pytest"]


def _readme_commands() -> list[list[str]]:
    """Every `paratrain ...` command line in the README: fenced bash blocks (continuation
    lines joined) and inline code spans."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`(paratrain [^`]+)`", README)
    out = []
    for line in lines:
        words = line.split("#")[0].split()
        if words[:1] == ["paratrain"] and len(words) > 1:
            out.append(words[1:])
    return out


def _resolve(words, cmds):
    two = " ".join(words[:2])
    return two if two in cmds else words[0]


def test_every_command_and_flag_in_the_readme_exists():
    cmds = {" ".join(path): cmd for path, cmd in _commands(get_command(app))}
    used = _readme_commands()
    assert len(used) >= 15
    for words in used:
        name = _resolve(words, cmds)
        assert name in cmds, f"README names `paratrain {name}`, which does not exist"
        opts = {o for p in cmds[name].params for o in p.opts + getattr(p, "secondary_opts", [])}
        opts.add("--help")
        flags = [f for w in words for f in w.strip("[]").split("=")[0].split("/")]
        for flag in (f for f in flags if f.startswith("--")):
            assert flag in opts, f"README uses {flag} with `paratrain {name}`"


def test_train_flags_are_the_documented_set():
    train = get_command(app).commands["train"]
    assert {o for p in train.params for o in p.opts} == TRAIN_FLAGS
