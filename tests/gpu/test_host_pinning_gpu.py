"""On CUDA: the host tier's page-locked blocks (flexicache_hf/host_memory.py, block_keeper.py) -- registered at their
exact size, seen as pinned by torch, addressed on the device at their host address, served by both copy paths (the
UVA page kernel and the 2D row copy) also when registered in pieces; a cache's host tier holds exactly its bytes and
honours host_memory_limit to the byte; a later cache reuses the blocks; the first forward pins every layer's blocks in
the background; copies and row selection take blocks and give them back; release_storage() frees what is kept;
failures are HostMemoryError.

Run on the lent H200 (never in CI): ``PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_host_pinning_gpu.py``.
"""

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import tiny_config, twin_models  # noqa: E402

from flexicache_hf import FlexiCache, HeadProfile, HostMemoryError, kept_storage_bytes, release_storage  # noqa: E402
from flexicache_hf.block_keeper import BLOCKS, BlockKeeper  # noqa: E402
from flexicache_hf.host_memory import PAGE, PinnedBlock, PinSettings  # noqa: E402
from flexicache_hf.rerank import SelectionObserver  # noqa: E402
from flexicache_hf.tiers import cuda_alias  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
SMALL = dict(page_size=16, token_budget=64, rerank_interval=4)


class Quiet(SelectionObserver):
    def on_rerank(self, event):
        pass


# Unsized and not compileable (an observer): a growing host tier of pinned blocks, not a reserved range; the same
# Triton kernels and UVA copies as any CUDA cache.
GROWING = {**SMALL, "observer": Quiet()}


@pytest.fixture(autouse=True)
def nothing_kept():
    """Every test starts and ends with nothing kept (storage or blocks)."""
    gc.collect()
    release_storage()
    yield
    gc.collect()
    release_storage()


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama on the GPU (fp32) and its config."""
    cfg = tiny_config("llama", heads=8, kv_heads=4, layers=3, head_dim=64, max_pos=4096)
    fc, _ = twin_models(cfg)
    return cfg, fc.to(DEV)


def greedy(model, ids, cache, n=12):
    """``n`` greedy tokens with ``cache``, eager."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, past_key_values=cache, disable_compile=True)


def expected_host_bytes(cache, batch, pages):
    """K and V of every layer's offloaded heads at ``pages`` pages, exactly (the cache's dtype: fp32 here)."""
    m, ps = cache.profile.model, cache.config.page_size
    heads = sum(len(cache.profile.stable_heads(i)) for i in range(m.num_layers))
    return 2 * batch * heads * pages * ps * m.head_dim * 4


# ---- one block --------------------------------------------------------------------------------------------------
def test_a_block_is_pinned_exact_and_addressed_on_the_device_at_its_host_address():
    from cuda.bindings import driver

    n = 3 * (1 << 20) + 4 * PAGE  # not a power of two: held exactly
    keeper = BlockKeeper(PinSettings(threads=4, chunk_bytes=PAGE * 64))
    t = keeper.acquire(n, PAGE, DEV)
    assert t.numel() == n and t.is_pinned() and t.data_ptr() % PAGE == 0
    err, dptr = driver.cuMemHostGetDevicePointer(t.data_ptr(), 0)
    assert err == driver.CUresult.CUDA_SUCCESS and int(dptr) == t.data_ptr()
    t.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    alias = cuda_alias(t, DEV)  # what the kernels and a captured graph read
    assert alias.device == DEV and alias.data_ptr() == t.data_ptr()
    assert torch.equal(alias.cpu(), t)
    alias[:PAGE].fill_(9)  # the device writes the host memory in place
    torch.cuda.synchronize()
    assert int(t[:PAGE].min()) == 9 == int(t[:PAGE].max())
    del t, alias
    assert keeper.stats()["kept_bytes"] == n
    assert keeper.release() == n and keeper.stats()["kept_bytes"] == 0


@pytest.mark.parametrize("piece_bytes", [None, 3 * 48 * 128 * 2 * 16])
def test_both_copy_paths_serve_registered_blocks_whole_or_in_pieces(piece_bytes):
    """The UVA page kernel and the 2D row copy (cuMemcpy2DAsync) on a block shaped as the host tier holds it --
    page-major ``[pages, B, H, ps, D]`` at :func:`tier_block`'s size and run -- registered once or in pieces of whole
    runs (what a block over 2 GiB falls back to; here every piece ends inside a page, between two (row, head) runs): a
    chunk written and read back span by span as the tier does, exact, the driver path never turned off (a 2D copy
    across pieces is redone one run at a time, for that copy only)."""
    from flexicache_hf.kernels import TRITON_OPS
    from flexicache_hf.pages import token_spans
    from flexicache_hf.tiers import tier_block

    B, H, pages, ps, D, dtype = 3, 5, 48, 16, 128, torch.bfloat16
    n, run = tier_block(B, H, ps, D, dtype, pages)
    assert run == ps * D * 2 and n == pages * B * H * run  # one page of one (row, head); the whole tier
    block = PinnedBlock(n, run, DEV.index, PinSettings(threads=2, piece_bytes=piece_bytes))
    assert len(block.spans) == (1 if piece_bytes is None else 5)
    assert all(size % (B * H * run) for _, size in block.spans[:-1])  # (pieces end inside a page)
    host = block.lend(lambda b: None).view(dtype).view(pages, B, H, ps, D)
    assert host.is_pinned()
    first, end = 5 * ps + 3, 45 * ps - 2  # a partial page, 39 whole pages (one 2D copy per (row, head)), a partial page
    spans = token_spans(first, end, ps)
    assert len(spans) == 3
    src = torch.randn(B, H, end - first, D, device=DEV).to(dtype)
    for span in spans:  # rows across every piece
        TRITON_OPS.copy_rows(span.pages(host), span.rows(src))
    torch.cuda.synchronize()
    assert all(torch.equal(span.pages(host), span.rows(src.cpu())) for span in spans)
    back = torch.empty_like(src)
    for span in spans:
        TRITON_OPS.copy_rows(span.rows(back), span.pages(host))
    pool = torch.zeros(64, ps, D, device=DEV, dtype=dtype)
    flat = host.view(-1, ps, D)  # flat page (p * B + b) * H + h, as HostTier.page_index
    src_i = torch.randperm(flat.shape[0], device=DEV)[:64]
    TRITON_OPS.copy_pages(pool, torch.arange(64, device=DEV), flat, src_i)
    torch.cuda.synchronize()
    assert torch.equal(back, src) and torch.equal(pool.cpu(), flat[src_i.cpu()])
    assert TRITON_OPS.copy_rows.__self__.unavailable is None  # (a fallback would have set why)
    assert TRITON_OPS.copy_pages.__self__.unavailable is None
    del host, flat
    block.free()  # (only once nothing views it: on a failure above the block is left mapped)


def test_failures_are_host_memory_errors():
    from flexicache_hf.host_memory import register

    block = PinnedBlock(4 * PAGE, PAGE, DEV.index)
    with pytest.raises(HostMemoryError, match="cuMemHostRegister"):
        register(block.addr, block.nbytes, DEV.index)  # registered already: the driver refuses
    block.free()
    keeper = BlockKeeper(PinSettings(threads=1))
    with pytest.raises(HostMemoryError):
        keeper.acquire(PAGE, PAGE, torch.cuda.device_count())  # no such device
    assert keeper.stats()["lent_bytes"] == 0


# ---- caches -----------------------------------------------------------------------------------------------------
def test_a_sized_cache_holds_exactly_its_bytes_and_honours_the_limit_to_the_byte(model):
    cfg, fc = model
    prof = HeadProfile.random(cfg, 0.25, seed=1)
    ids = torch.randint(2, 96, (3, 300), device=DEV)
    probe = FlexiCache(prof, **SMALL, max_cache_len=333)
    tokens = greedy(fc, ids, probe)
    need = expected_host_bytes(probe, 3, -(-(333 + 15) // 16))  # ceil((max_cache_len + page_size - 1) / page_size)
    assert probe.host_bytes() == need  # no power-of-two rounding
    assert all(t.is_pinned() for layer in probe.layers for t in (layer.storage.host.k, layer.storage.host.v))
    exact = FlexiCache(prof, **SMALL, max_cache_len=333, host_memory_limit=need)
    assert torch.equal(greedy(fc, ids, exact), tokens)
    pins = BLOCKS.stats()["pins"]
    short = FlexiCache(prof, **SMALL, max_cache_len=333, host_memory_limit=need - 1)
    with pytest.raises(HostMemoryError, match="host_memory_limit"):
        greedy(fc, ids, short)
    assert short.layers[0].seq_len == 0 and BLOCKS.stats()["pins"] == pins  # refused at layer 0, nothing pinned


def test_a_later_cache_of_the_same_shape_pins_nothing(model):
    cfg, fc = model
    prof = HeadProfile.random(cfg, 0.25, seed=2)
    ids = torch.randint(2, 96, (2, 700), device=DEV)
    first = greedy(fc, ids, FlexiCache(prof, **GROWING))  # growing: dropped at once, its blocks kept
    gc.collect()
    s0 = BLOCKS.stats()
    assert s0["kept_bytes"] > 0 and kept_storage_bytes() >= s0["kept_bytes"]
    again = greedy(fc, ids, FlexiCache(prof, **GROWING))
    s1 = BLOCKS.stats()
    assert torch.equal(first, again)
    assert s1["pins"] == s0["pins"] and s1["reused"] > s0["reused"], (s0, s1)
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) < 1 << 20  # not torch's allocator


def test_the_first_forward_pins_every_layers_blocks_in_the_background(model):
    cfg, fc = model
    prof = HeadProfile.random(cfg, 0.25, seed=3)
    s0 = BLOCKS.stats()
    cache = FlexiCache(prof, **GROWING)
    fc(torch.randint(2, 96, (2, 500), device=DEV), past_key_values=cache)
    s1 = BLOCKS.stats()
    offloading = sum(1 for layer in cache.layers if layer.storage.offloads)
    assert s1["prefetched"] + s1["reused"] - s0["prefetched"] - s0["reused"] == 2 * offloading
    assert s1["pinned_now"] == s0["pinned_now"] and s1["pending_bytes"] == 0
    assert s1["lent_bytes"] - s0["lent_bytes"] == cache.host_bytes()


def test_copies_and_row_selection_take_registered_blocks_and_give_them_back(model):
    cfg, fc = model
    prof = HeadProfile.random(cfg, 0.25, seed=4)
    cache = FlexiCache(prof, **GROWING)
    first = greedy(fc, torch.randint(2, 96, (2, 300), device=DEV), cache)
    base = BLOCKS.stats()["lent_bytes"] - cache.host_bytes()
    twin = copy.deepcopy(cache)  # re-pinned where it is made: blocks of its own
    pairs = [(a.storage.host, b.storage.host) for a, b in zip(cache.layers, twin.layers)]
    assert all(b.k.is_pinned() and b.k.data_ptr() != a.k.data_ptr() for a, b in pairs if a.k is not None)
    assert BLOCKS.stats()["lent_bytes"] == base + cache.host_bytes() + twin.host_bytes()
    follow = torch.cat([first, torch.randint(2, 96, (2, 9), device=DEV)], 1)
    assert torch.equal(greedy(fc, follow, twin), greedy(fc, follow, cache))
    held = twin.host_bytes()
    twin.batch_repeat_interleave(2)  # beam-style expansion: blocks of twice the rows, the old ones given back
    assert twin.host_bytes() == 2 * held
    assert BLOCKS.stats()["lent_bytes"] == base + cache.host_bytes() + twin.host_bytes()
    del pairs, twin
    gc.collect()
    assert BLOCKS.stats()["lent_bytes"] == base + cache.host_bytes()
    assert kept_storage_bytes() >= 2 * held  # (the unexpanded blocks may have made room for the expanded ones)
    assert release_storage() > 0 and kept_storage_bytes() == 0 and BLOCKS.stats()["kept_bytes"] == 0
