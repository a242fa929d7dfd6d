"""The user's path from their own data to the ecosystem, each step a test on one shared
run: `paratrain train --data notes.jsonl --tokenizer bpe:512 --tensorboard tb`,
`paratrain generate --checkpoint ck --prompt "def "`, `paratrain export`, and the export
loaded by `transformers` with paratrain's logits."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain.cli import main

MODEL = ["--layers", "2", "--d-model", "32", "--heads", "4", "--kv-heads", "2",
         "--d-ff", "64", "--context", "32"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
    """A 6-step run on notes.jsonl with a 512-token BPE and a fresh cache (one process
    here, to keep the suite short; load_full_model's own tests cover other layouts)."""
    root = tmp_path_factory.mktemp("flow")
    with open(text_file) as fh:
        text = fh.read()
    with (root / "notes.jsonl").open("w") as f:
        for i in range(0, len(text), 2000):
            f.write(json.dumps({"text": text[i:i + 2000], "source": "conftest"}) + "\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(root / "home"))
        code = main(["train", "--data", str(root / "notes.jsonl"), "--tokenizer", "bpe:512",
                     "--nproc", "1", *MODEL, "--steps", "6", "--global-batch", "8",
                     "--eval-every", "3", "--checkpoint-dir", str(root / "ck"),
                     "--run-dir", str(root / "run"), "--tensorboard", str(root / "tb"),
                     "--quiet"])
    return root, code


def test_train_on_jsonl_with_bpe(trained):
    root, code = trained
    assert code == 0
    cache = root / "home" / ".cache" / "paratrain"
    bpe = list(cache.glob("bpe-*-512.json"))
    assert len(bpe) == 1 and len(list(cache.glob("tokens-*.npz"))) == 1  # trained once
    assert (root / "ck" / "tokenizer.json").read_text() == bpe[0].read_text()
    meta = json.loads((root / "ck" / "step_000006" / "meta.json").read_text())
    assert meta["model"]["vocab_size"] == meta["tokenizer"]["vocab_size"] == 512
    recs = [json.loads(line) for line in (root / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in recs] == list(range(6))
    summary = json.loads((root / "run" / "summary.json").read_text())
    assert summary["tokenizer"] == "bpe:512"
    assert 0 < summary["val_bpb"] < summary["val_loss"] / torch.log(torch.tensor(2.0))
    assert recs[2]["val_bpb"] > recs[5]["val_bpb"] == summary["val_bpb"]  # it learns
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    losses = [e.value for e in events.Scalars("loss/train")]
    assert losses == pytest.approx([r["loss"] for r in recs], rel=1e-6)


def test_generate_from_the_checkpoint(trained, capsys):
    root, _ = trained
    ck = str(root / "ck")
    args = ["generate", "--checkpoint", ck, "--prompt", "def ", "--max-new-tokens", "12"]
    outs = []
    hot = ["--temperature", "0.8"]
    for extra in (["--temperature", "0"], ["--temperature", "0"], [*hot, "--seed", "1"],
                  [*hot, "--seed", "1"], [*hot, "--seed", "2", "--top-k", "1"]):
        assert main([*args, *extra]) == 0
        outs.append(capsys.readouterr().out.rstrip("\n"))
    assert all(o.startswith("def ") for o in outs) and len(outs[0]) > len("def ")
    assert outs[0] == outs[1] and outs[2] == outs[3]  # greedy; sampling with a seed
    assert outs[4] == outs[0]  # top-1 sampling is greedy whatever the seed
    from paratrain.config import ModelConfig
    from paratrain.files.checkpoint import load_full_model
    from paratrain.files.tokenizer import Tokenizer
    from paratrain.model import Decoder

    meta, state = load_full_model(ck)  # greedy's first token, computed by hand
    model = Decoder(ModelConfig(**meta["model"]))
    model.load_state_dict(state)
    tok = Tokenizer("bpe:512", (root / "ck" / "tokenizer.json").read_text())
    ids = tok.encode_text("def ")
    first = int(model(torch.tensor([ids]))[0, -1].argmax())
    assert outs[0].startswith(tok.decode([*ids, first]))
    assert main([*args, "--temperature", "-1"]) == 2
    assert "--temperature -1.0 must be >= 0" in capsys.readouterr().err


def _hf_logits_equal(ck, out, text):
    """Load ``out`` with transformers (offline) and compare logits with paratrain's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from paratrain.files.inference import load

    run = load(ck)
    hf = AutoModelForCausalLM.from_pretrained(out)
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert ids == run.tokenizer.encode_text(text) and hf_tok.decode(ids) == text
    x = torch.tensor([ids[:run.model.cfg.context]])
    with torch.no_grad():
        ours, theirs = run.model(x), hf(x).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_export_loads_in_transformers_with_equal_logits(trained, capsys):
    root, _ = trained
    assert main(["export", "--checkpoint", str(root / "ck"), "--out", str(root / "hf")]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    _hf_logits_equal(root / "ck", root / "hf", "def parse(self, s):\n    return s[1:]\n")


def test_export_of_a_bytes_model_with_tied_embeddings(tmp_path, capsys):
    """The other mapping cases without another training run: bytes tokenizer (its
    equivalent tokenizer.json), tied head, plain multi-head attention, a checkpoint
    from before tokenizers were recorded."""
    from dataclasses import asdict

    from paratrain.config import ModelConfig, TrainConfig
    from paratrain.files import checkpoint
    from paratrain.model import Decoder
    from paratrain.parallel.engine import Engine
    from paratrain.plan import ParallelPlan

    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=2, d_ff=48, context=24,
                      tie_embeddings=True, rope_theta=500.0)
    torch.manual_seed(0)
    model = Decoder(cfg)
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, so a misplaced gain shows
            p.add_(0.1 * torch.randn_like(p))
    engine = Engine(model, TrainConfig(), torch.device("cpu"))
    checkpoint.save(tmp_path / "ck", 1, engine, cfg, ParallelPlan(), {"model": asdict(cfg)})
    assert main(["export", "--checkpoint", str(tmp_path / "ck"),
                 "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    _hf_logits_equal(tmp_path / "ck", tmp_path / "hf", "é = {'x': 1}\n")


def test_resume_with_the_same_tokenizer_only(trained, capsys):
    """Last (it extends the shared checkpoint): the BPE run resumes from its checkpoint;
    another tokenizer is refused by the launcher, naming what differs."""
    root, _ = trained
    args = ["train", "--data", str(root / "notes.jsonl"), "--nproc", "1", *MODEL,
            "--global-batch", "8", "--eval-every", "3", "--checkpoint-dir", str(root / "ck"),
            "--run-dir", str(root / "run"), "--quiet", "--resume", "--steps", "8"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(root / "home"))
        assert main([*args, "--tokenizer", "bpe:300"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model.vocab_size=512 but this run has 300" in err[0], err
        assert main([*args, "--tokenizer", "bpe:512"]) == 0
    recs = [json.loads(line) for line in (root / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in recs] == list(range(8))
