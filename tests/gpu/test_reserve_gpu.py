"""Reserved storage on the GPU (``flexicache_hf/reserve.py``): an unsized FlexiCache decodes on CUDA graphs
(``generate``'s own compile, ``mode="reduce-overhead"``) over ``vmm`` ranges, growing a chunk at a time without a new
compile or a new CUDA graph recording; its tokens are a sized cache's, and its committed device and pinned host bytes
are within 5 % of a sized cache's holding the same tokens plus a chunk.

Run on a CUDA machine with VMM (never in CI): ``.venv/bin/python -m pytest tests/gpu/test_reserve_gpu.py -m gpu``.
"""

import collections

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from flexicache_hf import FlexiCache, HeadProfile, reserve
from flexicache_hf.vmm import vmm_supported

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or not vmm_supported(0):
    pytest.skip("needs CUDA with virtual memory management", allow_module_level=True)

CHUNK = 64


def recordings() -> int:
    from flexicache_hf.bench.generate import cudagraph_recordings

    return cudagraph_recordings()


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=32768,
                      pad_token_id=0, eos_token_id=511, bos_token_id=1)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache", torch_dtype=torch.bfloat16).cuda()


def generate(model, ids, mask, cache, new):
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)[:, ids.shape[1]:]


def test_unsized_graph_decode_grows_without_recapture(model, monkeypatch):
    monkeypatch.setattr(reserve, "CHUNK_TOKENS", CHUNK)
    profile = HeadProfile.random(model.config, 0.25, seed=1)
    ids = torch.randint(2, 500, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :7], mask[1, :7] = 0, 0
    new = 8 * CHUNK  # several chunks (and, at this shape, several device granules)
    torch._dynamo.reset()
    cache = FlexiCache(profile, page_size=16, token_budget=256)
    assert cache.is_compileable
    generate(model, ids, mask, cache, 4)  # prompt, the compile and the first recordings
    g0, r0 = graphs(), recordings()
    cache.reset()
    out = generate(model, ids, mask, cache, new)
    assert graphs() == g0 and recordings() == r0  # grew across chunks: no new program, no new recording
    sized = FlexiCache(profile, page_size=16, token_budget=256, max_cache_len=300 + new, model_config=model.config)
    assert torch.equal(out, generate(model, ids, mask, sized, new))
    near = FlexiCache(profile, page_size=16, token_budget=256, max_cache_len=300 + new + CHUNK,
                      model_config=model.config)
    generate(model, ids, mask, near, new)
    for what in ("device_bytes", "host_bytes"):
        got, ref = getattr(cache, what)(), getattr(near, what)()
        granules = 2 * 6 * len(cache.layers) * (2 << 20) if what == "device_bytes" else 0  # a granule per range
        assert got <= ref * 1.05 + granules, what
    res = cache.layers[0].storage.reserved
    assert res.committed < res.pages // 4  # far below the context


def test_prompt_past_the_context_is_refused(model):
    cache = FlexiCache(HeadProfile.random(model.config, 0.25, seed=1), model_config=model.config)
    ids = torch.randint(2, 500, (1, 64), device="cuda")
    generate(model, ids, torch.ones_like(ids), cache, 2)
    held = cache.device_bytes()
    with pytest.raises(ValueError, match="context"):
        model(torch.randint(2, 500, (1, 32768), device="cuda"), past_key_values=cache)
    assert cache.device_bytes() == held and cache.get_seq_length() == 65


def _first_prefill_syncs(layers: int) -> collections.Counter:
    """Host waits for the device (torch's sync debug mode) in the prefill of a cache's first forward, on a model of
    ``layers`` layers: a warm-up cache first (kernels built), then a new cache of another batch (fresh storage).
    Counted by where they happen: the waiting thread and the innermost frames of the project and transformers."""
    import threading
    import traceback
    import warnings

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=32768,
                      pad_token_id=0, eos_token_id=511, bos_token_id=1)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache", torch_dtype=torch.bfloat16).cuda()
    profile = HeadProfile.random(model.config, 0.25, seed=1)
    ids = torch.randint(2, 500, (3, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    generate(model, ids[:1], torch.ones_like(ids[:1]), FlexiCache(profile, page_size=16, token_budget=256), 1)
    torch.cuda.synchronize()
    cache = FlexiCache(profile, page_size=16, token_budget=256)
    waits = collections.Counter()

    def record(message, *_, **__):
        if "called a synchronizing" in str(message):
            frames = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                      if "flexicache_hf" in f.filename or "transformers" in f.filename]
            waits[(threading.current_thread().name, *frames[-3:])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            generate(model, ids, torch.ones_like(ids), cache, 1)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return waits


def test_a_first_prefill_waits_for_the_device_no_more_with_more_layers():
    """A first forward lays each layer out (storage, selections, reserved ranges) while the layers before it are still
    on the device: none of that waits for them (run 25: a wait per layer idled the device while the host page-locked
    that layer's tier), so a deeper model's first prefill waits as often as a shallow one's (generate's own waits)."""
    deep, shallow = _first_prefill_syncs(6), _first_prefill_syncs(2)
    assert sum(deep.values()) == sum(shallow.values()), (deep - shallow, shallow - deep)
