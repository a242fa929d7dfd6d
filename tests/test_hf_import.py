"""`paratrain train --init-from HF_DIR`: a LlamaForCausalLM folder (Mistral, Qwen2, Qwen3,
Mixtral, Qwen3-MoE) that transformers wrote (randomly initialised here, no hub) becomes
paratrain's model with transformers' logits;
a frozen run (--lr 0) exports the folder's tensors back bit for bit; tp2 x dp2 from it
reproduces one process; what paratrain cannot compute is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import max_rel_diff
from paratrain.cli import main

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64)
RUN = ["--nproc", "1", "--steps", "1", "--global-batch", "4", "--context", "16",
       "--eval-every", "0", "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _write_llama(path, seed: int, tokenizer: bool, arch: str = "Llama", **config) -> None:
    """A random LlamaForCausalLM (``arch`` Mistral, Qwen2, Qwen3: that one) saved by
    transformers itself, every weight (the norms' gains and Qwen2's biases too, which
    start at 1 and 0) perturbed so that a misplaced tensor shows."""
    import transformers

    from paratrain.files.tokenizer import bytes_tokenizer_json

    torch.manual_seed(seed)
    kind = getattr(transformers, f"{arch}ForCausalLM")
    model = kind(getattr(transformers, f"{arch}Config")(**SHAPE, **config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    if tokenizer:
        (path / "tokenizer.json").write_text(bytes_tokenizer_json())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """gqa: 2 KV heads, untied, eps 1e-6, theta 5000, its own tokenizer.json (a padded
    vocabulary of 300 over 256 byte tokens); tied: multi-head, tied head, vocabulary 256,
    no tokenizer.json (--tokenizer decides); mistral: MistralForCausalLM, GQA, a 48-token
    sliding window, theta 1e6; wide: heads of 16 over a width of 32 (4 heads), as Mistral
    NeMo's 128 over 5120 (32 heads); qwen2: Qwen2ForCausalLM (q, k, v biases), GQA, tied,
    theta 1e6; qwen3: Qwen3ForCausalLM (per-head q, k norms), GQA, heads of 16 (Qwen3's
    128 over 4096 / 32 shrunk); mixtral: MixtralForCausalLM, 4 experts, top 2; qwen3_moe:
    Qwen3MoeForCausalLM, 4 experts of width 24, top 2, q, k norms; qwen2_moe:
    Qwen2MoeForCausalLM, the same experts, not renormalised, and a gated shared expert of
    48 (two experts wide), q, k, v biases; phi3: Phi3ForCausalLM (q, k, v and gate, up
    stored fused), GQA, a 48-token window; llama3: Llama 3.1's
    RoPE scaling, shrunk so that at head width 8 one frequency is kept, one interpolated
    and two divided by the factor (wavelengths 6.3, 63, 628, 6283 against 16 / 2 and
    16 / 0.25)."""
    root = tmp_path_factory.mktemp("hf")
    _write_llama(root / "gqa", 0, True, vocab_size=300, num_key_value_heads=2,
                 rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False)
    _write_llama(root / "tied", 1, False, vocab_size=256, tie_word_embeddings=True)
    _write_llama(root / "llama3", 2, False, vocab_size=256, num_key_value_heads=2,
                 tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)
    _write_llama(root / "mistral", 3, False, "Mistral", vocab_size=256,
                 num_key_value_heads=2, sliding_window=48, rope_theta=1e6)
    _write_llama(root / "wide", 4, False, vocab_size=256, num_key_value_heads=2, head_dim=16)
    _write_llama(root / "qwen2", 5, False, "Qwen2", vocab_size=256, num_key_value_heads=2,
                 tie_word_embeddings=True, rope_theta=1e6)
    _write_llama(root / "qwen3", 6, False, "Qwen3", vocab_size=256, num_key_value_heads=2,
                 head_dim=16)
    _write_llama(root / "mixtral", 7, False, "Mixtral", vocab_size=256, num_key_value_heads=2,
                 num_local_experts=4, num_experts_per_tok=2)
    _write_llama(root / "qwen3_moe", 8, False, "Qwen3Moe", vocab_size=256,
                 num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=24, norm_topk_prob=True)
    _write_llama(root / "phi3", 10, False, "Phi3", vocab_size=256, num_key_value_heads=2,
                 sliding_window=48, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    _write_llama(root / "qwen2_moe", 9, False, "Qwen2Moe", vocab_size=256,
                 num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=24, shared_expert_intermediate_size=48,
                 norm_topk_prob=False)
    return root


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 0.25, "high_freq_factor": 2.0,
               "original_max_position_embeddings": 16}


def _settled(d, flags=None):
    from paratrain.config import ModelConfig, TrainConfig
    from paratrain.files import hf_import

    return hf_import.settle(str(d), ModelConfig(), TrainConfig(), None, flags or {})


def test_config_carries_every_setting(folders):
    mcfg, tcfg = _settled(folders / "gqa")
    assert (mcfg.n_layers, mcfg.d_model, mcfg.n_heads, mcfg.kv_heads, mcfg.d_ff,
            mcfg.vocab_size) == (2, 32, 4, 2, 64, 300)
    assert (mcfg.norm_eps, mcfg.rope_theta, mcfg.tie_embeddings) == (1e-6, 5000.0, False)
    assert mcfg.context == 64 and mcfg.experts == 0  # min(128, max_position_embeddings)
    assert tcfg.tokenizer == str((folders / "gqa" / "tokenizer.json").resolve())
    mcfg, tcfg = _settled(folders / "tied", {"model": {"context": 16}})
    assert mcfg.tie_embeddings and mcfg.kv_heads == 4 and mcfg.context == 16
    assert tcfg.tokenizer == "bytes" and mcfg.rope_factor == 1.0
    mcfg, _ = _settled(folders / "llama3")
    assert (mcfg.rope_factor, mcfg.rope_low_freq, mcfg.rope_high_freq,
            mcfg.rope_original_context) == (8.0, 0.25, 2.0, 16)


def test_llama3_rope_frequencies_follow_the_three_bands():
    """Kept above the high-frequency cut, divided by the factor below the low one,
    interpolated between (model.rope_frequencies), and unscaled at factor 1."""
    from paratrain.config import ModelConfig
    from paratrain.model import rope_frequencies

    plain = ModelConfig(d_model=32, n_heads=4)
    scaled = plain.replace(rope_factor=8.0, rope_low_freq=0.25, rope_high_freq=2.0,
                           rope_original_context=16)
    f, g = rope_frequencies(plain), rope_frequencies(scaled)
    assert torch.equal(f, 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    a = (16 * f[1] / (2 * torch.pi) - 0.25) / (2.0 - 0.25)  # wavelength 63: in (8, 64)
    assert 0 < a < 1 and g[0] == f[0] and torch.allclose(g[2:], f[2:] / 8, rtol=1e-15,
                                                         atol=0)
    assert g[1] == pytest.approx(float((1 - a) * f[1] / 8 + a * f[1]), rel=1e-15)
    with pytest.raises(ValueError, match="rope_high_freq=0.25 must exceed rope_low_freq"):
        scaled.replace(rope_high_freq=0.25)


ALL = ["gqa", "tied", "llama3", "mistral", "wide", "qwen2", "qwen3", "mixtral", "qwen3_moe",
       "qwen2_moe", "phi3"]


@pytest.mark.parametrize("name", ALL)
def test_logits_equal_transformers(folders, name):
    from transformers import AutoModelForCausalLM

    from paratrain.files import hf_import
    from paratrain.model import Decoder

    mcfg, _ = _settled(folders / name)
    model = Decoder(mcfg)
    hf_import.load_into(model, folders / name)
    hf = AutoModelForCausalLM.from_pretrained(folders / name)
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(x), hf.eval()(x).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["untied", "tied", "qkv_bias", "qk_norm", "moe", "moe every 2",
                                  "moe shared"])
def test_import_inverts_export_exactly(tmp_path, kind):
    """export's tensors and config (hf_state_dict, hf_config), written as a folder and
    read back by import's load_into, are the model's bit for bit, for every
    architecture's names."""
    from safetensors.torch import save_file

    from paratrain.config import ModelConfig
    from paratrain.files.export import hf_config, hf_state_dict
    from paratrain.files.hf_import import load_into
    from paratrain.model import Decoder

    cfg = ModelConfig(n_layers=2, d_model=48, n_heads=6, n_kv_heads=3, d_ff=40,
                      vocab_size=70, context=8, tie_embeddings=kind == "tied")
    cfg = cfg.replace(**{"qkv_bias": dict(qkv_bias=True), "qk_norm": dict(qk_norm=True),
                         "moe": dict(experts=4, top_k=2),  # Mixtral
                         "moe every 2": dict(experts=4, qk_norm=True, moe_ffn=24,
                                             moe_every=2),  # Qwen3-MoE
                         "moe shared": dict(experts=4, qkv_bias=True, shared_experts=1,
                                            shared_gate=True, moe_renorm=False),  # Qwen2-MoE
                         }.get(kind, {}))
    torch.manual_seed(0)
    sd = Decoder(cfg).state_dict()
    save_file(hf_state_dict(sd, cfg), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg)))
    torch.manual_seed(1)
    back = Decoder(cfg)
    load_into(back, tmp_path)
    assert back.state_dict().keys() == sd.keys()
    assert all(torch.equal(back.state_dict()[k], sd[k]) for k in sd)


@pytest.mark.parametrize("name", ALL)
def test_frozen_run_exports_the_folder_bit_for_bit(folders, tmp_path, text_file, capsys, name):
    """--lr 0 (weight decay 0.1 included) changes no weight: train, then export, gives
    the folder's tensors back, bit for bit, and its tokenizer."""
    from safetensors.torch import load_file

    from paratrain.files.hf_arch import BLOCK_NAMES, FUSED

    src = folders / name
    assert main(["train", "--init-from", str(src), "--lr", "0", *RUN, "--data", text_file,
                 "--checkpoint-dir", str(tmp_path / "ck"),
                 "--run-dir", str(tmp_path / "run")]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "ck"),
                 "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    theirs = load_file(str(src / "model.safetensors"))
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = json.loads((src / "config.json").read_text())
    if want["tie_word_embeddings"]:  # a tied head is the embedding; export leaves it out
        theirs.pop("lm_head.weight", None)
    for name_, parts in FUSED.get(want["model_type"], {}).items():  # Phi-3's: as Llama's
        for i in range(2):
            stacked = theirs.pop(f"model.layers.{i}.{name_}")
            ours_ = [f"model.layers.{i}.{BLOCK_NAMES[p]}" for p in parts]
            assert torch.equal(torch.cat([ours.pop(k) for k in ours_]), stacked)
    assert ours.keys() == theirs.keys()
    bad = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not bad, bad
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    for k in ("vocab_size", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"):
        assert config[k] == want[k], k
    assert config["head_dim"] == (want.get("head_dim") or 32 // 4)  # else hidden / heads
    # the Qwens export as themselves, Mistral and Phi-3 (their windows past the context,
    # Phi-3's tensors unfused) as Llama
    assert config["model_type"] == {"mistral": "llama", "phi3": "llama"}.get(
        name, want["model_type"])
    rope = {k: v for k, v in want["rope_parameters"].items() if k in LLAMA3_ROPE}
    assert {k: config["rope_parameters"][k] for k in rope} == rope
    if name in ("llama3", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "phi3"):
        from transformers import AutoModelForCausalLM

        x = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            a, b = (AutoModelForCausalLM.from_pretrained(d).eval()(x).logits
                    for d in (src, tmp_path / "out"))
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    if (src / "tokenizer.json").is_file():
        assert (tmp_path / "out" / "tokenizer.json").read_text() == \
            (src / "tokenizer.json").read_text()


def _variant(folders, tmp_path, base: str = "gqa", **changes):
    """A copy of the ``base`` folder with config.json keys changed (None: removed)."""
    d = tmp_path / "variant"
    shutil.copytree(folders / base, d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes, flags, fragment", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, [], "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, [], "'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, [],
     "rope_scaling has no low_freq_factor, high_freq_factor, original_max_position_embed"),
    ({"attention_bias": True}, [], "attention_bias=true"),
    ({"mlp_bias": True}, [], "mlp_bias=true"),
    ({"hidden_act": "gelu"}, [], "hidden_act='gelu'"),
    ({"head_dim": 16}, [], "q_proj.weight has shape (32, 32) but its config.json implies (64, 32)"),
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, [], "'gemma'"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, [],
     "the safetensors have no model.layers.0.self_attn.q_proj.bias"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": True},
     [], "attention_bias=true"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 8}, [], "--context 16 exceeds sliding_window=8"),
    ({}, ["--config", "qk.toml"], "qk_norm = True in the TOML contradicts model_type=llama"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 8},
     [], "--context 16 exceeds sliding_window=8"),
    ({"attention_dropout": 0.1}, [], "attention_dropout=0.1"),
    ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "resid_pdrop": 0.1}, [],
     "resid_pdrop=0.1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.75}}, [], "partial_rotary_factor=0.75"),
    ({"intermediate_size": None}, [], "has no intermediate_size"),
    ({"intermediate_size": 48}, [], "has shape (64, 32) but its config.json implies (48, 32)"),
    ({}, ["--layers", "3"], "--layers 3 contradicts num_hidden_layers=2"),
    ({}, ["--kv-heads", "4"], "--kv-heads 4 contradicts num_key_value_heads=2"),
    ({}, ["--experts", "4"], "its model is dense"),
    ({}, ["--context", "65"], "--context 65 exceeds max_position_embeddings=64"),
    ({}, ["--config", "rope.toml"], "rope_factor = 8.0 in the TOML contradicts rope "
     "factor=1.0"),
    ({}, ["--tokenizer", "bpe:300"], "--tokenizer bpe:300 contradicts"),
])
def test_what_paratrain_cannot_compute_is_refused_in_one_line(folders, tmp_path, capsys,
                                                              changes, flags, fragment):
    (tmp_path / "rope.toml").write_text("[model]\nrope_factor = 8.0\n")  # an unscaled folder
    (tmp_path / "qk.toml").write_text("[model]\nqk_norm = true\n")  # a Llama folder
    flags = [str(tmp_path / f) if f.endswith(".toml") else f for f in flags]
    _refused(["--init-from", str(_variant(folders, tmp_path, **changes)), *flags], fragment,
             capsys)


@pytest.mark.parametrize("changes, flags, fragment", [
    ({"mlp_only_layers": [1]}, [], "mlp_only_layers=[1]"),
    ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
      "shared_expert_intermediate_size": 36}, [],
     "shared_expert_intermediate_size=36, not a multiple of moe_intermediate_size=24"),
    ({}, ["--config", "renorm.toml"], "moe_renorm = False in the TOML contradicts "
     "norm_topk_prob=True"),
    ({"moe_intermediate_size": None}, [], "has no moe_intermediate_size"),
    ({}, ["--experts", "8"], "--experts 8 contradicts num_local_experts=4"),
    # the hub's Qwen3-MoE configs spell it num_experts (transformers 4.x)
    ({"num_local_experts": None, "num_experts": 4}, ["--experts", "8"],
     "--experts 8 contradicts num_experts=4"),
    ({}, ["--moe-ffn", "32"], "--moe-ffn 32 contradicts moe_intermediate_size=24"),
    ({}, ["--shared-experts", "1"],
     "--shared-experts 1 contradicts shared_expert_intermediate_size=0"),
])
def test_what_paratrains_moe_cannot_compute_is_refused(folders, tmp_path, capsys, changes,
                                                       flags, fragment):
    (tmp_path / "renorm.toml").write_text("[model]\nmoe_renorm = false\n")
    flags = [str(tmp_path / f) if f.endswith(".toml") else f for f in flags]
    d = _variant(folders, tmp_path, "qwen3_moe", **changes)
    _refused(["--init-from", str(d), *flags], fragment, capsys)


def test_the_router_renormalises_as_the_folder_says(folders, tmp_path):
    """norm_topk_prob (Qwen2-MoE's and Qwen3-MoE's) is moe_renorm; Mixtral always
    renormalises; Qwen2-MoE's shared expert is a whole number of experts wide, gated."""
    assert _settled(folders / "qwen3_moe")[0].moe_renorm
    assert not _settled(_variant(folders, tmp_path, "qwen3_moe",
                                 norm_topk_prob=False))[0].moe_renorm
    assert _settled(folders / "mixtral")[0].moe_renorm
    q2 = _settled(folders / "qwen2_moe")[0]
    assert (q2.moe_renorm, q2.shared_experts, q2.shared_gate, q2.qkv_bias) == \
        (False, 2, True, True)


def test_mixtral_experts_are_d_ff_wide(folders, capsys):
    mcfg, _ = _settled(folders / "mixtral")
    assert (mcfg.experts, mcfg.top_k, mcfg.expert_ffn, mcfg.moe_every) == (4, 2, 64, 1)
    _refused(["--init-from", str(folders / "mixtral"), "--moe-ffn", "32"],
             "--moe-ffn 32 contradicts intermediate_size=64", capsys)
    assert _settled(folders / "mixtral", {"model": {"moe_ffn": 64}})[0].expert_ffn == 64


def _refused(args: list[str], fragment: str, capsys) -> None:
    _refused_cmd(["train", *RUN, *args], fragment, capsys)  # args last: they win


def test_vocabulary_mismatch_and_bad_folders_are_one_line(folders, tmp_path, capsys):
    d = tmp_path / "no_tokenizer"
    shutil.copytree(folders / "gqa", d)
    (d / "tokenizer.json").unlink()  # vocabulary 300; --tokenizer bytes has 256
    _refused(["--init-from", str(d)], "has 256 tokens but vocab_size=300", capsys)
    _refused(["--init-from", str(tmp_path / "none")], "is not a directory", capsys)
    _refused(["--init-from", str(tmp_path)], "has no readable config.json", capsys)
    (d / "model.safetensors").unlink()
    _refused(["--init-from", str(d)], "has no model.safetensors", capsys)


@pytest.mark.parametrize("name", ["tied", "llama3", "mistral", "qwen2", "qwen3", "mixtral",
                                  "qwen3_moe", "qwen2_moe", "phi3"])
def test_generate_from_the_folder_is_transformers_greedy(folders, capsys, name):
    """`generate --init-from HF_DIR` samples from the folder itself: greedy, the same new
    tokens as transformers' own greedy generate (its context, prompt plus new tokens,
    inside max_position_embeddings and the Mistral window)."""
    from transformers import AutoModelForCausalLM

    from paratrain.files.inference import load_hf
    from paratrain.run.generate import sample

    prompt, n = "The quick brown fox", 16
    run = load_hf(folders / name, prompt, n)
    assert run.model.cfg.context == len(prompt.encode()) + n
    ids, new = sample(run, prompt, n)
    hf = AutoModelForCausalLM.from_pretrained(folders / name).eval()
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert new == out[0, len(ids):].tolist()
    assert main(["generate", "--init-from", str(folders / name), "--prompt", prompt,
                 "--max-new-tokens", str(n)]) == 0
    assert capsys.readouterr().out.rstrip("\n") == run.tokenizer.decode(ids + new)


def test_generate_stops_at_the_folders_end_of_sequence(folders, tmp_path, text_file, capsys):
    """With eos_token_id in generation_config.json (an id or a list), generation stops
    after the first one drawn, as transformers' greedy generate does; a run started from
    the folder keeps those ids beside its checkpoints, for generate and export."""
    from transformers import AutoModelForCausalLM

    from paratrain.files.inference import eos_ids, load_hf
    from paratrain.run.generate import sample

    d = tmp_path / "eos"
    shutil.copytree(folders / "tied", d)
    prompt, n = "The quick brown fox", 16
    _, free = sample(load_hf(d, prompt, n), prompt, n)
    stop = free[5]  # the sixth greedy token ends the text (its first occurrence)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [999, stop]}))
    assert eos_ids(d) == {999, stop}
    run = load_hf(d, prompt, n)
    ids, new = sample(run, prompt, n, eos=eos_ids(d))
    assert new == free[:free.index(stop) + 1]
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert new == out[0, len(ids):].tolist()
    assert main(["generate", "--init-from", str(d), "--prompt", prompt,
                 "--max-new-tokens", str(n)]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    assert text == run.tokenizer.decode(ids + new)
    # a run from the folder keeps its end of sequence: generate from the checkpoint stops
    # there too, and the export says it (config.json, generation_config.json)
    ck, out = tmp_path / "ck", tmp_path / "out"
    assert main(["train", "--init-from", str(d), "--lr", "0", *RUN, "--context", "48",
                 "--data", text_file, "--checkpoint-dir", str(ck),
                 "--run-dir", str(tmp_path / "run")]) == 0  # the context holds the text
    assert eos_ids(ck) == {999, stop}
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(ck), "--prompt", prompt,
                 "--max-new-tokens", str(n)]) == 0
    assert capsys.readouterr().out.rstrip("\n") == text
    assert main(["export", "--checkpoint", str(ck), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == sorted({999, stop})
    assert eos_ids(out) == {999, stop}
    out_ids = AutoModelForCausalLM.from_pretrained(out).eval().generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out_ids[0, len(ids):].tolist() == new


def test_generate_takes_one_source_and_a_tokenizer_that_fits(folders, tmp_path, capsys):
    _refused_cmd(["generate", "--prompt", "a"], "one of the two", capsys)
    _refused_cmd(["generate", "--prompt", "a", "--init-from", str(folders / "tied"),
                  "--checkpoint", str(tmp_path)], "one of the two", capsys)
    d = tmp_path / "no_tokenizer"
    shutil.copytree(folders / "gqa", d)
    (d / "tokenizer.json").unlink()  # vocabulary 300 and no tokenizer: bytes do not fit
    _refused_cmd(["generate", "--prompt", "a", "--init-from", str(d)],
                 "(bytes) has 256 tokens but vocab_size=300", capsys)


def _refused_cmd(args: list[str], fragment: str, capsys) -> None:
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error:"), err
    assert fragment in err, err


def test_lr_zero_is_accepted_and_negative_refused():
    from paratrain.config import TrainConfig

    assert TrainConfig(lr=0.0).lr == 0.0
    with pytest.raises(ValueError, match=r"lr = -1.0 \(--lr\): must be a number >= 0"):
        TrainConfig(lr=-1.0)


@pytest.mark.slow
@pytest.mark.parametrize("folder, layout", [("gqa", ["--nproc", "4", "--tp", "2"]),
                                            ("llama3", ["--nproc", "2", "--cp", "2"]),
                                            ("wide", ["--nproc", "2", "--tp", "2"]),
                                            ("wide", ["--nproc", "2", "--cp", "2"]),
                                            ("qwen3", ["--nproc", "2", "--tp", "2"]),
                                            ("qwen3_moe", ["--nproc", "4", "--tp", "2",
                                                           "--ep", "2"]),
                                            ("qwen2_moe", ["--nproc", "2", "--tp", "2"]),
                                            ("phi3", ["--nproc", "2", "--tp", "2"])])
def test_tp2_dp2_from_the_folder_matches_one_process(folders, tmp_path, text_file, folder,
                                                     layout):
    """Every rank takes its shard of the imported model: tp2 x dp2 (4 processes) follows
    the single process's float64 loss trajectory; so does cp 2 from the folder with Llama
    3's RoPE scaling (each rank's chunk rotated at its global positions' scaled angles),
    tp 2 and cp 2 from the one whose heads are wider than width / heads, tp 2 from
    Qwen3's (each rank's q, k norm gradients, a sum over its own heads, summed over tp),
    tp2 x ep2 from Qwen3-MoE's (each rank its experts), tp 2 from Qwen2-MoE's (its q, k,
    v biases split with their rows, its gated shared expert whole on every rank) and tp
    2 from Phi-3's (each rank's heads cut from the fused tensors). Every folder is loaded
    into the whole model before a layout takes its shards, so one run per kind of tensor
    suffices; tests/test_qwen_attention.py has the layouts."""
    losses = {}
    for name, flags in (("one", ["--nproc", "1"]), ("parallel", layout)):
        run = tmp_path / name
        r = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--init-from",
                            str(folders / folder), *flags, "--dtype", "float64", "--steps",
                            "3", "--global-batch", "4", "--context", "16", "--eval-every",
                            "0", "--quiet", "--data", text_file, "--run-dir", str(run)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        losses[name] = [json.loads(x)["loss"] for x in
                        (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["one"]) == 3
    assert max_rel_diff(losses["parallel"], losses["one"]) <= 1e-9


@pytest.mark.slow
def test_frozen_tp2_zero3_run_exports_the_folder_bit_for_bit(folders, tmp_path, text_file):
    """The shards every rank took (tp2 x dp2 with ZeRO-3: tensor-parallel slices of flat
    FSDP shards) are the folder's weights exactly: a frozen 4-process run's checkpoint
    exports them back bit for bit."""
    from safetensors.torch import load_file

    r = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "--init-from",
                        str(folders / "gqa"), "--nproc", "4", "--tp", "2", "--zero", "3",
                        "--lr", "0", *RUN[2:], "--data", text_file,
                        "--checkpoint-dir", str(tmp_path / "ck"),
                        "--run-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert main(["export", "--checkpoint", str(tmp_path / "ck"),
                 "--out", str(tmp_path / "out")]) == 0
    theirs = load_file(str(folders / "gqa" / "model.safetensors"))
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []


@pytest.mark.parametrize("changes, fragment", [
    (dict(qkv_bias=True, qk_norm=True), "both q, k, v biases and q, k norms"),
    (dict(experts=4, capacity_factor=1.0), "capacity_factor = 1.0"),
    (dict(experts=4, shared_experts=1), "shared_experts = 1"),
    (dict(experts=4, qkv_bias=True), "qkv_bias = True"),
    (dict(experts=4, moe_every=2), "moe_every = 2"),
    (dict(experts=4, moe_renorm=False), "moe_renorm = False"),
    (dict(experts=4, shared_experts=1, shared_gate=True), "shared_experts = 1"),
])
def test_export_refuses_what_no_transformers_class_computes(tmp_path, capsys, changes,
                                                            fragment):
    """One error line from `paratrain export`, naming the setting, for a checkpoint whose
    model no transformers architecture computes (hf_arch.architecture)."""
    from dataclasses import asdict

    from paratrain.config import ModelConfig, TrainConfig
    from paratrain.files import checkpoint
    from paratrain.model import Decoder
    from paratrain.parallel.engine import Engine
    from paratrain.plan import ParallelPlan

    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=48, context=16, **changes)
    engine = Engine(Decoder(cfg), TrainConfig(), torch.device("cpu"))
    checkpoint.save(tmp_path / "ck", 1, engine, cfg, ParallelPlan(), {"model": asdict(cfg)})
    _refused_cmd(["export", "--checkpoint", str(tmp_path / "ck"), "--out",
                  str(tmp_path / "hf")], fragment, capsys)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral"])
def test_plan_prices_a_folder_as_the_run_builds_it(folders, tmp_path, capsys, name):
    """`paratrain plan --model HF_DIR` reads the folder's config.json as --init-from does
    (no weights): the model it prices is the one the run would build."""
    from paratrain.cost.shapes import as_shape

    assert main(["plan", "--model", str(folders / name), "--gpus", "8", "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)["model"]
    built = as_shape(_settled(folders / name)[0])
    assert (priced["params"], priced["active_params"], priced["flops_per_token"]) == \
        (built.num_params(), built.active_params(), built.flops_per_token(4096))
    assert priced["name"] == name
    out = tmp_path / "run.toml"  # the winner's TOML, and a command that starts from it
    assert main(["plan", "--search", "--model", str(folders / name), "--gpus", "8",
                 "--context", "32", "--tokens", "1024", "--emit-config", str(out)]) == 0
    assert f"paratrain train --nproc 8 --init-from {folders / name} --config {out}" in \
        capsys.readouterr().out
    gemma = _variant(folders, tmp_path, model_type="gemma")
    _refused_cmd(["plan", "--model", str(gemma), "--gpus", "8"], "'gemma'", capsys)
