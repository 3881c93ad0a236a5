"""On CUDA: a prompt chunk after its prefix attends through SDPA's flash kernel (``causal_lower_right``, KV heads
grouped as they are) and matches the masked call with repeated KV heads it replaced, at the geometry of
Llama-3.1-8B; its peak memory holds no repeated heads.

Run on the lent H200 (never in CI): ``python -m pytest -q -m gpu tests/gpu/test_dense_gpu.py``.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flexicache_hf.dense import dense_attention, flash_lower_right  # noqa: E402


@pytest.mark.parametrize("T,L", [(1, 3000), (512, 4096), (1000, 3000)])
def test_chunk_after_prefix_takes_flash_and_matches_the_masked_call(T, L):
    torch.manual_seed(0)
    B, Hq, H, D = 2, 32, 8, 128
    q = torch.randn(B, Hq, T, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert flash_lower_right(q, k, v, 0.0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = dense_attention(q, k, v, None, D ** -0.5)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 2 * k.numel() * k.element_size()  # no copy of the keys and values per query head (4x each)
    mask = torch.ones(T, L, dtype=torch.bool, device="cuda").tril(L - T)
    want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(Hq // H, 1),
                                          v.float().repeat_interleave(Hq // H, 1), attn_mask=mask,
                                          scale=D ** -0.5).transpose(1, 2)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_float32_keeps_the_masked_call_and_half_precision_takes_flash():
    q = torch.randn(1, 8, 4, 64, device="cuda")
    k = torch.randn(1, 2, 16, 64, device="cuda")
    assert not flash_lower_right(q, k, k, 0.0)  # float32: no flash kernel
    assert flash_lower_right(q.half(), k.half(), k.half(), 0.0)
