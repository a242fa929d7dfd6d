"""Guard the user surface: the README's quick start, the commands it names, and the
train command's flags (a flag added or removed by accident fails here)."""

from __future__ import annotations

import re
from pathlib import Path

from typer.main import get_command

from paratrain.cli.app import app
from paratrain.cli.settings import schema

README = (Path(__file__).parents[1] / "README.md").read_text()

# `paratrain train`'s own launch options (no settings)
RUN_FLAGS = {
    "--checkpoint-dir", "--config", "--nproc", "--quiet", "--resume", "--run-dir",
    "--simulate-workers", "--tensorboard",
    "--keep-checkpoints", "--max-restarts", "--nnodes", "--node-rank", "--rdzv-endpoint",
    "--timeout", "--grace", "--plan", "--max-memory-gb", "--init-from",
    "resume_mode",  # hidden argument: the 'auto' of '--resume auto'
}
# The settings' flags, written out once more on purpose: the commands generate theirs from
# the dataclass fields (paratrain/cli/settings.py), so a field that gains or loses a flag
# by accident fails here.
SETTING_FLAGS = {
    "--attention", "--aux-loss-coef", "--bucket-mb", "--capacity-factor", "--ep", "--etp",
    "--experts", "--moe-every", "--moe-ffn", "--shared-experts", "--top-k", "--z-loss-coef",
    "--checkpoint-every", "--collectives",
    "--compress", "--context", "--cp", "--cp-algorithm", "--d-ff", "--d-model",
    "--data", "--dp", "--dp-replicate", "--dtype",
    "--eval-every", "--global-batch", "--heads", "--kv-heads", "--layers", "--lr",
    "--micro-batches", "--overlap", "--pp", "--recompute",
    "--reduce-dtype", "--schedule", "--seed", "--sp", "--steps",
    "--tie-embeddings", "--tp", "--virtual-stages", "--warmup-steps", "--zero",
    "--tokenizer", "--text-field",
}


def _commands(group, prefix=()):
    for name, cmd in getattr(group, "commands", {}).items():
        yield (*prefix, name), cmd
        yield from _commands(cmd, (*prefix, name))


def test_quick_start_is_exactly_install_run_test():
    block = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    cmds = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert cmds == ["./install.sh", "paratrain train", "python -m pytest"]


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


def _flags(command: str) -> set[str]:
    return {o for p in get_command(app).commands[command].params for o in p.opts}


def test_train_flags_are_the_documented_set():
    assert _flags("train") == RUN_FLAGS | SETTING_FLAGS


def test_the_schema_defines_the_setting_flags():
    every = {"model": None, "train": None, "plan": None}
    assert {s.flag for s in schema(every)} == SETTING_FLAGS


def test_plan_and_check_model_use_the_same_names_as_train():
    assert SETTING_FLAGS <= _flags("plan")
    model = {s.flag for s in schema({"model": None})}
    assert model | {"--global-batch", "--data"} <= _flags("check-model")
