"""Checkpoints that cannot lose work or run code (docs/faults.md, "What a checkpoint
survives"): pruning beside damaged or foreign steps, a crafted ``.metadata``, a malformed
``meta.json``, a step DCP cannot read, generate/export falling back out loud, export's
--out checked first, one permission policy. Real files; real torchrun workers where the
path runs in them (``train --resume``)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import tiny_flags
from paratrain.cli import main

TRAIN = [sys.executable, "-m", "paratrain.cli", "train", "--nproc", "2", "--zero", "3",
         *tiny_flags(), "--global-batch", "4", "--eval-every", "0", "--quiet",
         "--dtype", "float64"]


def _rehash(d: Path) -> None:
    """Recompute meta.json's sha256s, as anyone who can write the step can."""
    meta = json.loads((d / "meta.json").read_text())
    meta["files"] = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in meta["files"]}
    (d / "meta.json").write_text(json.dumps(meta))


def _flip(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0xFF
    path.write_bytes(bytes(b))


class _Marker:
    """A pickle that writes a file when unpickled (``exec`` through ``__reduce__``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({str(self.path)!r}, 'w').write('ran')",))


def _craft(d: Path, marker: Path) -> None:
    (d / ".metadata").write_bytes(pickle.dumps(_Marker(marker)))
    _rehash(d)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint dir written in this process by ``checkpoint.save``: steps 4, 6, 8."""
    import torch

    from paratrain.config import ModelConfig, TrainConfig
    from paratrain.files import checkpoint
    from paratrain.model import Decoder
    from paratrain.parallel.engine import Engine
    from paratrain.plan import ParallelPlan

    root = tmp_path_factory.mktemp("saved") / "ck"
    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_ff=32, context=8, vocab_size=256)
    torch.manual_seed(0)
    engine = Engine(Decoder(cfg), TrainConfig(), torch.device("cpu"))
    for step in (4, 6, 8):
        checkpoint.save(root, step, engine, cfg, ParallelPlan(), {"model": asdict(cfg)})
    return root


@pytest.fixture
def ck(saved, tmp_path) -> Path:
    out = tmp_path / "ck"
    shutil.copytree(saved, out)
    return out


def _generate(ck: Path, capsys) -> tuple[int, str, str]:
    code = main(["generate", "--checkpoint", str(ck), "--prompt", "ab", "--max-new-tokens",
                 "3", "--temperature", "0"])
    got = capsys.readouterr()
    return code, got.out, got.err


def _one_fallback_warning(err: str, damaged: str, fragment: str, to: str) -> None:
    lines = _lines(err)
    assert len(lines) == 1 and lines[0].startswith("warning: checkpoint ") \
        and damaged in lines[0] and fragment in lines[0] \
        and lines[0].endswith(f"falling back to {to}"), err
    assert "Traceback" not in err


# ---- 7: generate and export say so when they pass over a damaged step ------------------
def test_generate_and_export_warn_and_name_the_step_they_load(ck, tmp_path, capsys):
    _flip(ck / "step_000008" / "__0_0.distcp")
    code, out, err = _generate(ck, capsys)
    assert code == 0 and out.startswith("ab"), err
    _one_fallback_warning(err, "step_000008", "__0_0.distcp fails its sha256 check",
                          "step_000006")
    assert main(["export", "--checkpoint", str(ck), "--out", str(tmp_path / "hf")]) == 0
    got = capsys.readouterr()
    _one_fallback_warning(got.err, "step_000008", "sha256", "step_000006")
    assert got.out.startswith(f"wrote step 6 of {ck}: ")


# ---- 4: a crafted .metadata runs no code ----------------------------------------------
def test_crafted_metadata_runs_no_code_in_generate_or_export(ck, tmp_path, capsys):
    marker = tmp_path / "marker"
    _craft(ck / "step_000008", marker)
    code, out, err = _generate(ck, capsys)
    assert not marker.exists(), "unpickling .metadata ran the crafted code"
    assert code == 0 and out.startswith("ab"), err
    _one_fallback_warning(err, "step_000008", ".metadata names builtins.exec", "step_000006")
    assert main(["export", "--checkpoint", str(ck), "--out", str(tmp_path / "hf")]) == 0
    got = capsys.readouterr()
    assert not marker.exists()
    _one_fallback_warning(got.err, "step_000008", "refused: it could run code", "step_000006")
    assert got.out.startswith("wrote step 6 ")


def test_metadata_naming_a_file_outside_the_list_is_refused(ck, capsys):
    """A .metadata of the admitted classes whose storage entries read a file meta.json
    does not list (so no sha256 covers it)."""
    from paratrain.files.checkpoint.safe_metadata import read_metadata

    d = ck / "step_000008"
    md = read_metadata(d, json.loads((d / "meta.json").read_text())["files"])
    for info in md.storage_data.values():
        info.relative_path = "../step_000006/__0_0.distcp"
    (d / ".metadata").write_bytes(pickle.dumps(md))
    _rehash(d)
    code, _, err = _generate(ck, capsys)
    assert code == 0
    _one_fallback_warning(err, "step_000008", "which meta.json does not list", "step_000006")


# ---- 5 and the paths of meta.json: a malformed meta.json is a damaged step -------------
def _outside(meta: dict, d: Path) -> dict:
    """An absolute path to a file outside the step (a real one, with its real sha256)."""
    other = (d.parent / "latest").resolve()
    meta["files"][str(other)] = hashlib.sha256(other.read_bytes()).hexdigest()
    return meta


MALFORMED = {
    "a list": (lambda m, d: [], "holds a JSON list"),
    "format only": (lambda m, d: {"format": 2}, "has no step"),
    "step four": (lambda m, d: {**m, "step": "four"}, "has step 'four'"),
    "no files": (lambda m, d: {**m, "files": {}}, "not a non-empty object"),
    "a file outside": (_outside, "latest', which is not a file name inside the step"),
    "a parent path": (lambda m, d: {**m, "files": {**m["files"], "../x": "0" * 64}}, "'../x'"),
    "a model that is not one": (lambda m, d: {**m, "model": {"d_model": "wide"}}, "model"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_meta_json_falls_back_like_any_damaged_step(ck, capsys, case):
    from paratrain.files import checkpoint

    change, fragment = MALFORMED[case]
    path = ck / "step_000008" / "meta.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()), path.parent)))
    assert checkpoint.peek(ck)["step"] == 6  # the launcher's view: no traceback
    code, _, err = _generate(ck, capsys)
    assert code == 0
    _one_fallback_warning(err, "step_000008", fragment, "step_000006")


# ---- 1: pruning ------------------------------------------------------------------------
@pytest.mark.parametrize(("found", "written", "keep", "intact", "gone"), [
    ([8, 6, 5, 4], 5, 2, {5, 4}, []),  # damaged 8, 6 above the step written: untouched
    ([100, 6, 4, 2], 6, 2, {100, 6, 4, 2}, [2]),  # another run's step 100: untouched
    ([10, 9, 8, 6], 10, 2, {10, 8, 6}, [9, 6]),  # damaged 9 is not counted, and goes
    ([6, 4, 2], 6, 1, {6, 4, 2}, [4, 2]),
    ([6, 4, 2], 6, 0, set(), []),  # 0: keep everything
])
def test_which_steps_a_save_deletes(found, written, keep, intact, gone):
    from paratrain.files.checkpoint.prune import to_delete

    assert to_delete(found, written, keep, lambda s: s in intact) == gone


def test_prune_on_real_steps_counts_only_intact_ones(ck):
    from paratrain.files import checkpoint
    from paratrain.files.checkpoint.prune import prune

    shutil.copytree(ck / "step_000008", ck / "step_000010")
    meta = json.loads((ck / "step_000010" / "meta.json").read_text())
    (ck / "step_000010" / "meta.json").write_text(json.dumps({**meta, "step": 10}))
    _flip(ck / "step_000006" / "__0_0.distcp")
    gone = prune(ck, checkpoint.steps(ck), 10, 2, checkpoint.step_dir)
    assert gone == [6, 4] and checkpoint.steps(ck) == [10, 8]


# ---- 8: export's --out, checked before anything is read --------------------------------
@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs Linux's /sys (unwritable)")
@pytest.mark.parametrize("where", ["under a file", "a file", "unwritable"])
def test_export_out_is_checked_before_loading(ck, tmp_path, capsys, where):
    (tmp_path / "afile").write_text("x")
    out = {"under a file": tmp_path / "afile" / "sub", "a file": tmp_path / "afile",
           "unwritable": Path("/sys/paratrain-export-test")}[where]
    _flip(ck / "step_000008" / "__0_0.distcp")  # loading first would print a warning
    assert main(["export", "--checkpoint", str(ck), "--out", str(out)]) == 2
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith(f"error: --out {str(out)!r}"), err
    assert not Path("/sys/paratrain-export-test").exists()


# ---- 17: one permission policy, the umask ----------------------------------------------
def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_save_and_export_follow_the_umask(saved, tmp_path, capsys):
    import torch

    from paratrain.config import ModelConfig, TrainConfig
    from paratrain.files import checkpoint
    from paratrain.model import Decoder
    from paratrain.parallel.engine import Engine
    from paratrain.plan import ParallelPlan

    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_ff=32, context=8, vocab_size=256)
    old = os.umask(0o027)
    try:
        engine = Engine(Decoder(cfg), TrainConfig(), torch.device("cpu"))
        checkpoint.save(tmp_path / "ck", 2, engine, cfg, ParallelPlan(), {"model": asdict(cfg)})
        assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--out",
                     str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    modes = {**_modes(tmp_path / "ck"), **_modes(tmp_path / "hf")}
    assert "latest" in modes and "step_000002/meta.json" in modes \
        and "model.safetensors" in modes
    assert set(modes.values()) == {0o640}, modes


# ---- real workers: train --resume -------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
    """A 2-process ZeRO-3 run under umask 027: steps 4, 6, 8 in ck/, metrics in run/."""
    tmp = tmp_path_factory.mktemp("trained")
    r = subprocess.run([*TRAIN, "--steps", "8", "--data", text_file, "--run-dir",
                        str(tmp / "run"), "--checkpoint-dir", str(tmp / "ck"),
                        "--checkpoint-every", "2", "--keep-checkpoints", "3"],
                       capture_output=True, text=True, timeout=300, cwd=tmp,
                       preexec_fn=lambda: os.umask(0o027))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp


def _resume(trained, tmp_path, text_file, *extra, steps=9):
    ck = tmp_path / "ck"
    if not ck.exists():
        shutil.copytree(trained / "ck", ck)
    run = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    r = subprocess.run([*TRAIN, "--steps", str(steps), "--data", text_file, "--run-dir",
                        str(run), "--checkpoint-dir", str(ck), "--resume", *extra],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["step"] \
        if (run / "metrics.jsonl").is_file() else None
    return r, ck, first


@pytest.mark.slow
def test_a_run_writes_every_file_under_the_umask(trained):
    modes = {**_modes(trained / "ck"), **_modes(trained / "run")}
    assert {"latest", "tokenizer.json", "step_000008/meta.json", "metrics.jsonl"} <= set(modes)
    assert set(modes.values()) == {0o640}, modes


@pytest.mark.slow
def test_crafted_metadata_runs_no_code_in_the_workers(trained, tmp_path, text_file):
    marker = tmp_path / "marker"
    shutil.copytree(trained / "ck", tmp_path / "ck")
    _craft(tmp_path / "ck" / "step_000008", marker)
    r, ck, first = _resume(trained, tmp_path, text_file)
    assert not marker.exists(), "a worker unpickled the crafted .metadata"
    assert r.returncode == 0, r.stderr[-3000:]
    _one_fallback_warning(r.stderr, "step_000008", "rank 0, 1: .metadata names builtins.exec",
                          "step_000006")
    assert first == 6


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["distcp zeroed", "metadata truncated"])
def test_a_step_dcp_cannot_read_is_one_warning_line(trained, tmp_path, text_file, damage):
    """Sha256s recomputed, content bad: one line naming the step, the rank and the reason
    (it was 53 lines with four torch tracebacks, or "CheckpointException ranks:...")."""
    shutil.copytree(trained / "ck", tmp_path / "ck")
    d = tmp_path / "ck" / "step_000008"
    if damage == "distcp zeroed":
        b = bytearray((d / "__1_0.distcp").read_bytes())
        b[100:400] = bytes(300)
        (d / "__1_0.distcp").write_bytes(bytes(b))
        fragment = "rank 1: reading it failed: RuntimeError: PytorchStreamReader failed"
    else:
        (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:1000])
        fragment = "rank 0, 1: .metadata does not unpickle"
    _rehash(d)
    r, _, first = _resume(trained, tmp_path, text_file)
    assert r.returncode == 0, r.stderr[-3000:]
    _one_fallback_warning(r.stderr, "step_000008", fragment, "step_000006")
    assert first == 6


@pytest.mark.slow
def test_malformed_newest_meta_json_resumes_from_the_step_before(trained, tmp_path,
                                                                 text_file):
    """``[]`` as the newest meta.json: the launcher's checks and the workers pass over it
    (it was a launcher traceback)."""
    shutil.copytree(trained / "ck", tmp_path / "ck")
    (tmp_path / "ck" / "step_000008" / "meta.json").write_text("[]")
    r, _, first = _resume(trained, tmp_path, text_file)
    assert r.returncode == 0, r.stderr[-3000:]
    _one_fallback_warning(r.stderr, "step_000008", "rank 0, 1: meta.json holds a JSON list",
                          "step_000006")
    assert first == 6


@pytest.mark.slow
def test_pruning_after_a_fallback_keeps_the_new_and_the_intact_steps(trained, tmp_path,
                                                                     text_file, capsys):
    """Steps 6 and 8 damaged: the resume falls back to 4 and writes 5 under
    --keep-checkpoints 2. Kept: 5 (latest) and 4; 6 and 8 are above the step written and
    untouched. Before, 5 and 4 were deleted and ``latest`` named a deleted step."""
    from paratrain.files import checkpoint

    shutil.copytree(trained / "ck", tmp_path / "ck")
    for s in (6, 8):
        _flip(tmp_path / "ck" / f"step_{s:06d}" / "__1_0.distcp")
    r, ck, first = _resume(trained, tmp_path, text_file, "--checkpoint-every", "1",
                           "--keep-checkpoints", "2", steps=5)
    assert r.returncode == 0, r.stderr[-3000:]
    assert first == 4 and len(_lines(r.stderr)) == 2, r.stderr[-3000:]
    assert checkpoint.steps(ck) == [8, 6, 5, 4]
    assert (ck / "latest").read_text() == "step_000005"
    assert checkpoint.load_full_model(ck)[0]["step"] == 5
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(ck), "--out", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.startswith("wrote step 5 ")
