"""Triton kernels against :mod:`flexicache_hf.kernels.reference`, on the CPU, under ``TRITON_INTERPRET=1``.

Triton picks the interpreter when a kernel is *defined*, so the interpreted checks must import the kernel
modules in a process that had the variable set from the start.  In a normal ``pytest`` run this module
defines one test that re-runs this same file in a child pytest with ``TRITON_INTERPRET=1``; in that child
(or in any run started with the variable set) it defines the real checks.  No GPU is needed.

The cuda-python copy kernel cannot run in the interpreter: its host-side planning (launch chunks, grid
caps, vector width) and its CPU fallback are tested here; the kernel itself in ``tests/gpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import live_part, schedule_steps_agree, top_k_lowest_ids

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---- copy_pages host side (no Triton, runs in both processes) ---------------------------------------------
def test_the_copy_kernel_build_falls_back_from_its_program_cache(monkeypatch):
    """The copy kernel is built through cuda.core's program cache; a cache that fails (unwritable, a damaged entry,
    a cuda.core whose compile takes no cache) costs a plain NVRTC build, never the kernel."""
    import types

    from flexicache_hf.kernels import uva_copy

    calls = []

    class Program:
        def __init__(self, source, code_type, options):
            assert source == uva_copy._SOURCE and code_type == "c++" and options == ("sm_90", "flexicache_uva_copy")

        def compile(self, target, cache=None):
            calls.append(cache)
            if cache is not None and cache.broken:
                raise TypeError("compile() got an unexpected keyword argument 'cache'")
            return types.SimpleNamespace(get_kernel=lambda name: ("kernel", name, cache is not None))

    class Cache:
        def __init__(self, broken):
            self.broken, self.closed = broken, False

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.closed = True

    core = types.SimpleNamespace(Program=Program, ProgramOptions=lambda arch, name: (arch, name))
    monkeypatch.setattr(uva_copy, "cuda_core", lambda: core)
    for broken, through_cache in ((False, True), (True, False)):
        cache = Cache(broken)
        monkeypatch.setattr(uva_copy, "_program_cache", lambda: cache)
        calls.clear()
        assert uva_copy.compile_copy_kernel("sm_90") == ("kernel", uva_copy._KERNEL_NAME, through_cache)
        assert calls == ([cache] if through_cache else [cache, None]) and cache.closed
    calls.clear()
    assert uva_copy.compile_copy_kernel("sm_90", cached=False)[2] is False and calls == [None]
    monkeypatch.setattr(uva_copy, "_program_cache", lambda: None)  # no cache in this cuda.core
    assert uva_copy.compile_copy_kernel("sm_90")[2] is False


def test_copy_plan_caps_grid_and_chunks():
    from flexicache_hf.kernels.uva_copy import Launch, plan_launches

    plan = plan_launches(10_000, True, host_grid=32, device_grid=1024, chunk_pages=4096)
    assert plan == [Launch(0, 4096, 32, 128), Launch(4096, 4096, 32, 128), Launch(8192, 1808, 32, 57)]
    assert plan_launches(5, False, host_grid=32, device_grid=1024, chunk_pages=4096) == [Launch(0, 5, 5, 1)]
    assert plan_launches(3000, False, host_grid=32, device_grid=1024, chunk_pages=4096) == [Launch(0, 3000, 1000, 3)]
    assert plan_launches(0, True, host_grid=32, device_grid=1024, chunk_pages=4096) == []
    # one launch (a captured step's): every block takes as many windows, a window at most the block's threads
    assert plan_launches(10_240, True, host_grid=32, device_grid=1024, chunk_pages=None) == [Launch(0, 10_240, 32, 160)]
    assert plan_launches(20_480, True, host_grid=32, device_grid=1024, chunk_pages=None) == [Launch(0, 20_480, 32, 214)]
    assert plan_launches(20_480, True, host_grid=32, device_grid=1024, chunk_pages=None, threads=1024) == \
        [Launch(0, 20_480, 32, 320)]  # two windows a block: the kernel's shared memory holds 512 entries
    assert plan_launches(10**6, False, host_grid=32, device_grid=1024, chunk_pages=None, threads=1024) == \
        [Launch(0, 10**6, 1024, 489)]
    assert plan_launches(0, True, host_grid=32, device_grid=1024, chunk_pages=None) == []
    for m in (1, 7, 100, 4097, 10_239, 99_999):
        for touches_host, cap in ((True, 32), (False, 1024)):
            (launch,) = plan_launches(m, touches_host, host_grid=32, device_grid=1024, chunk_pages=None)
            windows = -(-m // launch.window)
            assert 1 <= launch.window <= 256 and launch.grid == min(cap, windows)  # no block without a window
            assert -(-windows // launch.grid) == -(-m // (cap * 256))  # each block as few windows as can be


def test_a_captured_copy_is_one_launch():
    """Eager copies are cut into launches of ``chunk_pages``; inside a captured graph (replayed every step, the index
    lists as long as the most pages a step may copy) one launch does the same work."""
    from flexicache_hf.kernels.uva_copy import PageCopier

    copier = PageCopier(chunk_pages=4096)
    assert copier.launch_chunk(capturing=False) == 4096
    assert copier.launch_chunk(capturing=True) is None


def test_copy_vector_width():
    from flexicache_hf.kernels.uva_copy import vector_width

    assert vector_width(4096, 0, 1 << 20) == 16
    assert vector_width(4096, 8, 1 << 20) == 8  # a pool base only 8-byte aligned
    assert vector_width(24, 0, 0) == 8
    assert vector_width(6, 0, 0) == 1


def test_copy_falls_back_to_torch_on_cpu():
    from flexicache_hf.kernels.uva_copy import PageCopier

    src = torch.randn(6, 4, 8)
    dst = torch.zeros(5, 4, 8)
    di = torch.tensor([3, -1, 0, 4])
    si = torch.tensor([5, 2, 1, 0])
    PageCopier().copy_pages(dst, di, src, si)  # CPU <-> CPU: no CUDA device -> torch indexing
    want = torch.zeros(5, 4, 8)
    want[3], want[0], want[4] = src[5], src[1], src[0]
    assert torch.equal(dst, want)


def test_copy_kv_pages_falls_back_to_torch_on_cpu():
    from flexicache_hf.kernels.uva_copy import PageCopier

    g = torch.Generator().manual_seed(0)
    sk, sv = torch.randn(6, 4, 8, generator=g), torch.randn(6, 4, 8, generator=g)
    dk, dv = torch.zeros(5, 4, 8), torch.zeros(5, 4, 8)
    di = torch.tensor([3, -1, 0, 4])
    si = torch.tensor([5, 2, 1, 0])
    PageCopier().copy_kv_pages(dk, dv, di, sk, sv, si)
    for dst, src in ((dk, sk), (dv, sv)):
        want = torch.zeros(5, 4, 8)
        want[3], want[0], want[4] = src[5], src[1], src[0]
        assert torch.equal(dst, want)


def test_copy_usable_decides_kernel_or_fallback():
    """Which tensor pairs the UVA kernel takes (fake CUDA tensors: no GPU needed to decide)."""
    from types import SimpleNamespace

    from flexicache_hf.kernels.uva_copy import PageCopier

    def fake(dev, pinned=False, dtype=torch.float16, shape=(4, 16, 64), contiguous=True):
        return SimpleNamespace(device=torch.device(dev), is_pinned=lambda: pinned, dtype=dtype, shape=shape,
                               is_contiguous=lambda: contiguous)

    c = PageCopier()
    assert c.usable(fake("cuda:0"), fake("cpu", pinned=True)) == torch.device("cuda:0")
    assert c.usable(fake("cpu", pinned=True), fake("cuda:0")) == torch.device("cuda:0")
    assert c.usable(fake("cuda:0"), fake("cuda:0")) == torch.device("cuda:0")
    assert c.usable(fake("cuda:0"), fake("cpu")) is None  # pageable host memory
    assert c.usable(fake("cuda:0"), fake("cuda:1")) is None  # two devices
    assert c.usable(fake("cuda:0"), fake("cuda:0", dtype=torch.float32)) is None
    assert c.usable(fake("cuda:0"), fake("cuda:0", contiguous=False)) is None
    assert c.usable(fake("cpu", pinned=True), fake("cpu", pinned=True)) is None


def test_split_plan():
    from flexicache_hf.kernels.sparse_decode import plan_splits

    assert plan_splits(65, 320, 132, 4) == (4, 20)  # batch 40 x 8 heads, budget 1024: ~8 programs per SM
    s, pps = plan_splits(625, 8, 132, 4)  # batch 1, dense 10k: many splits of >= 2 blocks
    assert s * pps >= 625 and pps % 4 == 0 and pps >= 8 and s > 40
    assert plan_splits(3, 8, 132, 4) == (1, 4)


def test_strided_grid_caps_programs_over_rows():
    """A row of blocks gets all its programs while the launch stays under ROW_PROGRAMS, else as many as fit (never
    fewer than one), and each program then strides over several blocks."""
    from flexicache_hf.kernels._util import ROW_PROGRAMS, strided_grid

    assert strided_grid(17, 128) == 17  # a sized cache's row: unchanged
    assert strided_grid(2048, 32) == ROW_PROGRAMS // 32  # a row reserved for a whole context: capped
    assert strided_grid(5, 10**6) == 1 and strided_grid(1, 0) == 1


def test_page_scores_programs_per_row():
    """page_scores starts PROGRAMS_PER_ROW programs a row (each striding over its tiles), more when too few rows would
    leave multiprocessors idle, never more than a row has tiles nor than the launch-wide cap allows."""
    import torch

    from flexicache_hf.kernels.scores import PROGRAMS_PER_ROW, row_programs

    cpu = torch.device("cpu")  # counts as 8 multiprocessors
    assert row_programs(512, 40, cpu) == PROGRAMS_PER_ROW  # 8 rows x 5 heads, 16k-page rows: capped
    assert row_programs(512, 1, cpu) == PROGRAMS_PER_ROW  # one row: 16 already fills 2 x 8 multiprocessors
    assert row_programs(3, 40, cpu) == 3  # a sized cache's short row: its tiles
    assert row_programs(512, 10**6, cpu) == 1  # the launch-wide cap wins


if not INTERPRETED:

    def test_triton_kernels_under_interpreter():
        """Run this file's interpreted checks in a child pytest with TRITON_INTERPRET=1 (CPU only)."""
        env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                           env=env, capture_output=True, text=True, timeout=900)
        tail = (r.stdout[-6000:] + "\n" + r.stderr[-3000:]).strip()
        assert r.returncode == 0, f"interpreted kernel checks failed:\n{tail}"
        print(f"interpreted kernel checks passed in {time.time() - t0:.1f} s\n{tail.splitlines()[-1]}")

else:
    from flexicache_hf.kernels import reference as R
    from flexicache_hf.kernels.append import append_token
    from flexicache_hf.kernels import TRITON_OPS
    from flexicache_hf.kernels.minmax import minmax_update
    from flexicache_hf.kernels.page_lse import page_lse
    from flexicache_hf.kernels.scores import page_scores
    from flexicache_hf.kernels.select import select_pages
    from flexicache_hf.kernels.slots import place_page, reseat_slots
    from flexicache_hf.kernels.sparse_decode import sparse_decode

    def dense_attention_reference(
        query: torch.Tensor,  # [B, Hq, D]
        keys: torch.Tensor,  # [B, H, L, D]
        values: torch.Tensor,  # [B, H, L, D]
        valid_lo: torch.Tensor,  # [B]
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, D]
        """Dense single-query attention over every valid token: what a budget covering all pages must equal."""
        B, Hq, D = query.shape
        H, L = keys.shape[1], keys.shape[2]
        q = query.float().view(B, H, Hq // H, D)
        logits = torch.einsum("bhgd,bhld->bhgl", q, keys.float()) * scale
        pos = torch.arange(L, device=query.device)
        logits = logits.masked_fill((pos[None, :] < valid_lo[:, None])[:, None, None], float("-inf"))
        out = torch.einsum("bhgl,bhld->bhgd", torch.softmax(logits, -1), values.float())
        return out.reshape(B, Hq, D).to(query.dtype)

    DTYPES = [torch.float32, torch.float16, torch.bfloat16]
    # ‖out - ref‖ / ‖ref‖ budgets: fp32 math vs fp32 reference; fp16/bf16 round P to the storage dtype
    # before P@V (as flash attention does) and round the output.
    REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}

    def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
        out, ref = out.double(), ref.double()
        assert not torch.isnan(out).any()
        return float((out - ref).norm() / ref.norm().clamp_min(1e-30))

    def make_minmax(B, H, cap, D, dtype):
        """An empty MinMax cache as the layer holds it: ``[B, H, cap, D]`` views of page-major ``[cap, B, H, D]``
        storage (the kernels address it through its strides)."""
        return (torch.full((cap, B, H, D), float("inf"), dtype=dtype).permute(1, 2, 0, 3),
                torch.full((cap, B, H, D), float("-inf"), dtype=dtype).permute(1, 2, 0, 3))

    def test_triton_ops_table():
        assert TRITON_OPS.name == "triton" and TRITON_OPS.sparse_decode is sparse_decode

    # ---- minmax_update ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("ps", [8, 16])
    def test_minmax_prompt_then_decode(dtype, ps):
        torch.manual_seed(1)
        B, H, D, L = 3, 2, 64, 5 * ps + 3  # partly filled last page
        cap = L // ps + 3
        keys = torch.randn(B, H, L + 4, D).to(dtype)
        valid_lo = torch.tensor([0, 5, ps + 2])  # left padding: inside page 0 and a whole first page
        ours, ref = make_minmax(B, H, cap, D, dtype), make_minmax(B, H, cap, D, dtype)
        steps = [(0, L - 2), (L - 2, L - 1), (L - 1, L), (L, L + 1), (L + 1, L + 4)]  # chunk, chunk, decode...
        for a, b in steps:
            minmax_update(*ours, keys[:, :, a:b], a, valid_lo, ps)
            R.minmax_update(*ref, keys[:, :, a:b], a, valid_lo, ps)
            assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1]), (a, b)
        assert torch.isinf(ours[0][2, :, 0]).all()  # a page of pure padding keeps its sentinels

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_append_token_matches_reference(dtype):
        torch.manual_seed(5)
        B, H, D, ps, P, cap = 2, 3, 64, 8, 40, 6
        pools = [torch.randn(P, ps, D).to(dtype) for _ in range(2)]
        k_min, k_max = make_minmax(B, H, cap, D, dtype)
        k_min[:, :, :2], k_max[:, :, :2] = -1.0, 1.0  # a page already holding tokens
        # HF's [B, H, 1, D] view of a [B, 1, H, D] projection: non-contiguous over heads
        key = torch.randn(B, 1, H, D).to(dtype).transpose(1, 2)[:, :, 0]
        value = torch.randn(B, 1, H, D).to(dtype).transpose(1, 2)[:, :, 0]
        for page, off in ((1, 3), (2, 0)):  # into a filled page, then a fresh one
            rows = torch.randperm(P)[: B * H].view(B, H) * ps + off
            page_t = torch.tensor([page])
            ours = [t.clone() for t in (*pools, k_min, k_max)]
            ref = [t.clone() for t in (*pools, k_min, k_max)]
            assert ours[2].stride()[2] == B * H * D  # the layer's page-major MinMax cache, through its strides
            append_token(*ours, key, value, rows, page_t)
            R.append_token(*ref, key, value, rows, page_t)
            for a, b in zip(ours, ref):
                assert torch.equal(a, b), page
            assert torch.equal(ours[0].view(-1, D)[rows.reshape(-1)], key.reshape(-1, D))
            assert torch.equal(ours[2][:, :, page], torch.minimum(k_min[:, :, page], key)), page

    # Tiles of 8 / 16 pages; pages longer than one unrolled group of 16 tokens; one-token pages; D not a power of 2.
    @pytest.mark.parametrize("D,ps,T,start", [(128, 16, 301, 0), (64, 8, 1000, 5), (64, 64, 700, 40),
                                              (32, 1, 90, 3), (80, 32, 333, 17)])
    def test_minmax_long_chunk_non_contiguous_keys(D, ps, T, start):
        """A long chunk (several tiles of pages per (row, head), a chunk starting inside a page) from HF's
        transposed key view."""
        torch.manual_seed(2)
        B, H = 2, 3
        keys = torch.randn(B, T, H, D, dtype=torch.float16).transpose(1, 2)  # HF's [B, H, T, D] view
        valid_lo = torch.tensor([0, 37])
        cap = (start + T) // ps + 2
        ours, ref = make_minmax(B, H, cap, D, torch.float16), make_minmax(B, H, cap, D, torch.float16)
        minmax_update(*ours, keys, start, valid_lo, ps)
        R.minmax_update(*ref, keys, start, valid_lo, ps)
        assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])

    # ---- page_scores -----------------------------------------------------------------------------------
    @pytest.mark.parametrize("group", [1, 3, 4, 7])
    @pytest.mark.parametrize("D", [64, 128])
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("combine", ["max", "mass"])
    def test_page_scores(group, D, dtype, combine):
        torch.manual_seed(3)
        B, H, ps, L = 2, 3, 16, 150
        cap = L // ps + 4
        kmin, kmax = make_minmax(B, H, cap, D, dtype)
        R.minmax_update(kmin, kmax, torch.randn(B, H, L, D).to(dtype), 0, torch.tensor([0, 40]), ps)
        q = torch.randn(B, H * group, D).to(dtype)
        n = L // ps + 1
        for heads in (torch.tensor([2, 0]), torch.arange(H)):
            ours = page_scores(q, kmin, kmax, heads, n, None, combine, 0.1)
            ref = R.page_scores(q, kmin, kmax, heads, n, None, combine, 0.1)
            assert ours.dtype == torch.float32 and ours.shape == ref.shape
            assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))  # padding-only pages: -inf
            fin = torch.isfinite(ref)
            torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-5, atol=1e-4)

    @pytest.mark.parametrize("shrink", [0.0, 0.5])
    @pytest.mark.parametrize("combine", ["max", "mass"])
    def test_page_scores_narrowed_box(shrink, combine):
        """bound_shrink < 1: the Triton kernel scores the narrowed box as the reference does, and the reference
        is ``q . c + shrink * sum |q| h`` (centre c, half-range h)."""
        torch.manual_seed(5)
        B, H, G, ps, L, D = 2, 2, 7, 8, 100, 64
        cap = L // ps + 3
        kmin, kmax = make_minmax(B, H, cap, D, torch.float16)
        R.minmax_update(kmin, kmax, torch.randn(B, H, L, D).half(), 0, torch.tensor([0, 20]), ps)
        q = torch.randn(B, H * G, D).half()
        n, heads = L // ps + 1, torch.arange(H)
        ours = page_scores(q, kmin, kmax, heads, n, None, combine, 0.125, shrink)
        ref = R.page_scores(q, kmin, kmax, heads, n, None, combine, 0.125, shrink)
        assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
        fin = torch.isfinite(ref)
        torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-5, atol=1e-4)
        if combine == "max":
            lo, hi = kmin[:, :, :n].float(), kmax[:, :, :n].float()
            c, h = (lo + hi) / 2, (hi - lo) / 2
            qg = q.float().view(B, H, G, 1, D)
            want = ((qg * c[:, :, None]).sum(-1) + shrink * (qg.abs() * h[:, :, None]).sum(-1)).amax(2)
            torch.testing.assert_close(ref[fin], want[fin], rtol=1e-5, atol=1e-4)
        assert not torch.equal(ref, R.page_scores(q, kmin, kmax, heads, n, None, combine, 0.125))

    def decode_step_scores_inputs(seed: int, B=2, H=4, ps=16, L=150, D=64):
        """A decode step's page-score inputs: fp16 MinMax cache with spare capacity (a left-padded row), queries
        of 2 heads per KV head, the page count as a device tensor."""
        torch.manual_seed(seed)
        kmin, kmax = make_minmax(B, H, L // ps + 6, D, torch.float16)
        R.minmax_update(kmin, kmax, torch.randn(B, H, L, D).half(), 0, torch.tensor([0, 40]), ps)
        return torch.randn(B, H * 2, D).half(), kmin, kmax, torch.tensor([L // ps + 1])

    @pytest.mark.parametrize("combine", ["max", "mass"])
    def test_page_scores_device_count_and_active_heads(combine):
        """The decode step's form: the page count read on the device, every head, only the due ones scored; with
        4-page blocks, programs wholly past the count (10 live pages of 15) read nothing (their pages, and the rows
        of heads not scored, are left to the live-part rule)."""
        q, kmin, kmax, n = decode_step_scores_inputs(4)
        B, H, cap = kmin.shape[0], kmin.shape[1], kmin.shape[2]
        active = torch.tensor([True, False, True, False])
        ref = R.page_scores(q, kmin, kmax, torch.arange(H), n, active, combine)
        for block_p, programs in ((None, None), (4, None), (4, 1)):  # programs=1: one program strides a row
            ours = page_scores(q, kmin, kmax, torch.arange(H), n, active, combine, block_p=block_p, programs=programs)
            assert ours.shape == ref.shape == (B, H, cap)
            ours = live_part(ours, n, active)
            assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
            fin = torch.isfinite(ref)
            torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-5, atol=1e-4)

    def test_rerank_with_a_rule_per_kind_of_head_matches_reference():
        """The Reranker's split scoring (unstable heads by the full bound's group maximum, stable ones by the mass
        of a shrunk box) on the Triton kernels: the same scores and the same selection as on the reference's."""
        from flexicache_hf.kernels import REFERENCE_OPS
        from flexicache_hf.kernels import TRITON_OPS
        from flexicache_hf.rerank import Reranker

        q, kmin, kmax, n = decode_step_scores_inputs(5)
        B, H = kmin.shape[0], kmin.shape[1]
        got = []
        for ops in (TRITON_OPS, REFERENCE_OPS):
            r = Reranker(B, H, (1, 2), 4, 1, torch.device("cpu"), stable_scoring=("mass", 0.5),
                         unstable_scoring=("max", 1.0))
            scores = r.rerank(ops, q, kmin, kmax, n, due=torch.tensor(True), scale=0.125)
            got.append((scores, r.selected.clone()))
        (ours, ours_sel), (ref, ref_sel) = got
        assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
        fin = torch.isfinite(ref)
        torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-5, atol=1e-4)
        assert torch.equal(ours_sel, ref_sel)

    # ---- select_pages ----------------------------------------------------------------------------------
    def select_rows(kind, B, h, width, n, seed):
        """Scores of ``kind`` with -inf holes, one row with only the newest page selectable, and past the ``n``
        live pages what a kernel reading there would select (NaN, +inf)."""
        g = torch.Generator().manual_seed(seed)
        if kind == "ties":  # three values: the threshold falls inside a run of ties
            s = torch.randint(0, 3, (B, h, width), generator=g).float()
        elif kind == "low bits":  # keys that differ in the last digit only: every radix pass runs
            s = 1.0 + torch.randint(0, 40, (B, h, width), generator=g).float() * 2.0 ** -23
        else:
            s = torch.randn(B, h, width, generator=g)
        s[0, 0, ::3] = float("-inf")
        s[B - 1, h - 1] = float("-inf")
        s[:, 0, n:] = float("nan")
        s[:, 1:, n:] = float("inf")
        return s

    @pytest.mark.parametrize("n,width,k,kind", [
        (23, 97, 8, "randn"), (10, 160, 4, "ties"), (37, 148, 40, "low bits"), (16, 256, 1, "randn"),
        (1, 16, 4, "randn"), (50, 200, 16, "ties"), (33, 132, 33, "low bits")])
    def test_select_pages_reads_only_the_live_pages(n, width, k, kind):
        """Rows reserved 4-16x wider than their live pages (garbage past them), ties, -inf holes, k = 1 and
        k > live pages, widths not a power of two; blocks of 16 (many per row) and the default (one)."""
        B, h = 2, 3
        s = select_rows(kind, B, h, width, n, n + width + k)
        want = top_k_lowest_ids(s, k, n)
        if kind == "randn":  # no ties: the reference's topk picks the same pages
            assert torch.equal(want, R.select_pages(s, k, num_pages=torch.tensor([n])))
        for block in (16, None):
            ours = select_pages(s, k, num_pages=torch.tensor([n]), block=block)
            assert ours.dtype == torch.long and ours.shape == (B, h, k)
            assert torch.equal(ours, want), (block, ours, want)
        assert ours[B - 1, h - 1].tolist() == [n - 1] + [-1] * (k - 1)

    def test_select_pages_in_place_for_active_rows():
        B, h, width, n, k = 2, 3, 150, 37, 8
        s = select_rows("ties", B, h, width, n, 5)
        active = torch.tensor([True, False, True])
        before = torch.full((B, h, k), 7, dtype=torch.long)
        want = torch.where(active[None, :, None], top_k_lowest_ids(s, k, n), before)
        for block in (16, None):
            ours = before.clone()
            assert select_pages(s, k, num_pages=torch.tensor([n]), active=active, out=ours, block=block) is ours
            assert torch.equal(ours, want)  # the inactive head keeps its selection
        ref = before.clone()
        s = torch.randn(B, h, width, generator=torch.Generator().manual_seed(6))
        R.select_pages(s, k, num_pages=torch.tensor([n]), active=active, out=ref)
        assert torch.equal(select_pages(s, k, num_pages=torch.tensor([n]), active=active, out=before), ref)

    @pytest.mark.parametrize("margin, keep", [(0.0, None), (1.0, None), (0.5, (True, False))])
    def test_select_pages_into_mapped_heads_with_a_margin(margin, keep):
        """Each kind of head selected straight into its heads of a wider selection (``heads``), with the stable
        heads' margin applied in the kernel (``keep_margin``, on the ``keep`` rows): the reference's selection, the
        other heads' rows untouched, and the scores scaled in place as the reference scales them."""
        B, H, width, n, k = 2, 5, 120, 41, 6
        g = torch.Generator().manual_seed(11)
        heads, active = torch.tensor([3, 0]), torch.tensor([True, True])
        keep_t = None if keep is None else torch.tensor(keep)
        before = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(B * H)]).view(B, H, k)
        before[0, 3, -2:] = -1  # a row holding fewer pages
        s = torch.rand(B, 2, width, generator=g) + 0.1
        want_s, ours_s = s.clone(), s.clone()
        want, ours = before.clone(), before.clone()
        R.select_pages(want_s, k, num_pages=torch.tensor([n]), active=active, out=want, heads=heads,
                       keep_margin=margin, keep=keep_t)
        select_pages(ours_s, k, num_pages=torch.tensor([n]), active=active, out=ours, heads=heads, keep_margin=margin,
                     keep=keep_t, block=16)
        assert torch.equal(ours, want)
        assert torch.equal(ours[:, [1, 2, 4]], before[:, [1, 2, 4]])
        torch.testing.assert_close(ours_s[..., :n], want_s[..., :n])
        if margin:
            assert not torch.equal(want_s, s)  # the margin did scale some pages

    def test_select_pages_heads_and_margin_need_out():
        """A head map or a margin without the selection it maps into / keeps is refused by both twins."""
        s = torch.rand(1, 2, 10)
        for fn in (R.select_pages, select_pages):
            for kw in ({"heads": torch.tensor([1, 0])}, {"keep_margin": 1.0}):
                with pytest.raises(ValueError, match="need out"):
                    fn(s, 3, **kw)

    @pytest.mark.parametrize("P,k", [(1, 4), (5, 8), (40, 4), (40, 40), (300, 16), (1000, 128), (2100, 130)])
    def test_select_pages(P, k):
        torch.manual_seed(P + k)
        B, h = 2, 3
        s = torch.randn(B, h, P)
        s[0, 0, : P // 2] = float("-inf")  # unselectable (padding) pages: fewer selectable than k
        s[1, 2, :] = float("-inf")  # only the forced last page is selectable
        if P > 3:
            s[1, 1, 3] = float("inf")
        ours = select_pages(s, k)
        assert ours.dtype == torch.long and ours.shape == (B, h, k)
        assert torch.equal(ours, R.select_pages(s, k))
        assert torch.equal(select_pages(s, k, block=64, num_warps=2), ours)
        assert (ours[1, 2, 1:] == -1).all() and ours[1, 2, 0] == P - 1

    def test_select_pages_ties_take_lowest_ids():
        s = torch.zeros(1, 1, 10)
        s[0, 0, 7] = 1.0
        out = select_pages(s, 4)  # page 9 forced, page 7 the best, then ties 0 and 1
        assert out.tolist() == [[[0, 1, 7, 9]]]

    # ---- sparse_decode ---------------------------------------------------------------------------------
    def paged_setup(B, H, group, D, ps, L, dtype, seed, valid_lo=None):
        """Random paged KV: a shuffled page table into pools with a null page 0 and unused pages."""
        g = torch.Generator().manual_seed(seed)
        P = -(-L // ps)
        cap = P + 2
        N = 1 + B * H * cap + 5
        k_pool = torch.randn(N, ps, D, generator=g).to(dtype)
        v_pool = torch.randn(N, ps, D, generator=g).to(dtype)
        table = (1 + torch.randperm(N - 1, generator=g)[: B * H * cap]).view(B, H, cap).int()
        q = torch.randn(B, H * group, D, generator=g).to(dtype)
        if valid_lo is None:
            valid_lo = torch.zeros(B, dtype=torch.long)
        return q, k_pool, v_pool, table, valid_lo, P

    def dense_of(k_pool, table, L, ps):
        """[B, H, L, D] tokens of the paged pool, for the dense reference."""
        B, H = table.shape[:2]
        P = -(-L // ps)
        pages = k_pool[table[:, :, :P].long()]  # [B, H, P, ps, D]
        return pages.reshape(B, H, P * ps, -1)[:, :, :L]

    CASES = [  # group, D, page size, dtype, length (partly filled last page in each)
        (1, 64, 16, torch.float32, 71),
        (3, 64, 8, torch.float16, 53),
        (4, 128, 16, torch.bfloat16, 90),
        (4, 64, 16, torch.float16, 37),
        (3, 128, 8, torch.float32, 45),
        (1, 128, 16, torch.bfloat16, 33),
    ]

    @pytest.mark.parametrize("group,D,ps,dtype,L", CASES)
    def test_sparse_decode_lists(group, D, ps, dtype, L):
        B, H = 2, 2
        q, kp, vp, table, _, P = paged_setup(B, H, group, D, ps, L, dtype, seed=L,
                                             valid_lo=None)
        valid_lo = torch.tensor([0, ps + 3])  # row 1 left-padded past its first page
        g = torch.Generator().manual_seed(7)
        W = 5
        pages = torch.full((B, H, W), -1, dtype=torch.long)
        for b in range(B):
            for h in range(H):
                n = 1 + (b + h) % min(W, P)  # different list lengths, -1 padded (also in the middle)
                sel = torch.randperm(P - 1, generator=g)[: n - 1]
                row = torch.cat([sel, torch.tensor([P - 1])])
                pages[b, h, :n] = row
        pages[0, 1, 0], pages[0, 1, -1] = -1, pages[0, 1, 0].clone()
        scale = D ** -0.5
        ref = R.sparse_decode(q, kp, vp, table, pages, valid_lo, L, scale)
        for splits, block_n in ((None, None), (1, None), (2, None), (None, 128), (2, 32)):
            out = sparse_decode(q, kp, vp, table, pages, valid_lo, L, scale, num_splits=splits, block_n=block_n)
            assert out.dtype == dtype and out.shape == q.shape
            assert rel_err(out, ref) < REL_TOL[dtype], (splits, block_n)
        # the decode step's form: the length read on the device gives the same result
        assert torch.equal(sparse_decode(q, kp, vp, table, pages, valid_lo, torch.tensor([L]), scale),
                           sparse_decode(q, kp, vp, table, pages, valid_lo, L, scale))

    @pytest.mark.parametrize("group,D,ps,dtype,L", CASES)
    def test_full_budget_equals_dense(group, D, ps, dtype, L):
        B, H = 2, 2
        q, kp, vp, table, _, P = paged_setup(B, H, group, D, ps, L, dtype, seed=L + 1)
        valid_lo = torch.tensor([3, 0])
        pages = torch.arange(P).expand(B, H, P).contiguous()
        scale = D ** -0.5
        dense = dense_attention_reference(q, dense_of(kp, table, L, ps), dense_of(vp, table, L, ps), valid_lo, scale)
        for splits in (None, 1, 3):
            out = sparse_decode(q, kp, vp, table, pages, valid_lo, L, scale, num_splits=splits)
            assert rel_err(out, dense) < REL_TOL[dtype], splits

    def test_pipeline_scores_select_decode_matches_reference():
        """The whole decode step (score due heads, select top-k, attend) against the reference chain."""
        torch.manual_seed(11)
        B, H, group, D, ps, L, k = 2, 2, 4, 64, 16, 250, 6
        q, kp, vp, table, _, P = paged_setup(B, H, group, D, ps, L, torch.float32, seed=3)
        valid_lo = torch.tensor([0, 20])
        kmin, kmax = make_minmax(B, H, table.shape[2], D, torch.float32)
        R.minmax_update(kmin, kmax, dense_of(kp, table, L, ps), 0, valid_lo, ps)
        heads = torch.arange(H)
        ours = select_pages(page_scores(q, kmin, kmax, heads, P), k)
        ref = R.select_pages(R.page_scores(q, kmin, kmax, heads, P), k)
        assert torch.equal(ours, ref)
        out = sparse_decode(q, kp, vp, table, ours, valid_lo, L, D ** -0.5)
        want = R.sparse_decode(q, kp, vp, table, ref, valid_lo, L, D ** -0.5)
        assert rel_err(out, want) < 1e-5

    # ---- reseat_slots ----------------------------------------------------------------------------------
    ROW_KINDS = ("sorted", "shuffled", "unchanged", "all new", "holes", "empty")

    def wanted_row(kind: str, resident: torch.Tensor, K: int, cap: int, g: torch.Generator) -> torch.Tensor:
        """One (row, slot head)'s wanted pages ``[K]`` of a kind: ``sorted`` (a re-rank's: ascending, -1 padded at
        the end, any count), ``shuffled`` (no order), ``unchanged`` (exactly the resident pages), ``all new`` (K
        pages none of which is resident), ``holes`` (a rewind's: ascending with -1 anywhere, front included),
        ``empty`` (all -1).  No page twice (the callers' contract)."""
        row = torch.full((K,), -1, dtype=torch.long)
        if kind == "unchanged":
            have = resident[resident >= 0].sort().values[:K]
            row[: have.numel()] = have
            return row
        pool = torch.randperm(cap, generator=g)
        if kind == "all new":
            pool = pool[~torch.isin(pool, resident)]
        n = {"empty": 0, "all new": min(K, pool.numel())}.get(kind, int(torch.randint(0, K + 1, (1,), generator=g)))
        pick = pool[:n]
        if kind == "holes":
            at = torch.randperm(K, generator=g)[:n].sort().values
            row[at] = pick.sort().values
        else:
            row[:n] = pick if kind == "shuffled" else pick.sort().values
        return row

    @pytest.mark.parametrize("S,K", [(5, 4), (7, 5), (3, 1), (40, 27), (130, 128), (259, 256)])
    def test_reseat_slots_matches_reference_over_rounds(S, K):
        """Rounds of wanted rows of every kind (``wanted_row``: sorted, shuffled, unchanged, all new, with -1 holes,
        empty; several kinds in one launch), some rounds predicated on or off: the slot rows (free slots among them),
        the page table (a flat buffer with its spare entry, heads not in slot order, entries never written kept)
        and the returned promotions are the reference's, round after round.  (259, 256): the product's defaults
        (budget 2048, 8-token pages, R = 16); (130, 128): the paper's."""
        g = torch.Generator().manual_seed(S * 100 + K)
        B, H, nT, cap = 2, 3, 2, max(40, 3 * K)
        heads = torch.tensor([2, 0])
        phys = (1 + torch.randperm(B * nT * S, generator=g)).view(B, nT, S)
        table = torch.randint(0, 99, (B * H * cap + 1,), generator=g, dtype=torch.int32)
        states = [(torch.full((B, nT, S), -1, dtype=torch.long), table.clone()) for _ in range(2)]
        for rnd in range(12):
            (sp_r, tb_r), (sp_t, tb_t) = states
            kinds = [[ROW_KINDS[(rnd + b * nT + t) % len(ROW_KINDS)] for t in range(nT)] for b in range(B)]
            wanted = torch.stack([torch.stack([wanted_row(kinds[b][t], sp_r[b, t], K, cap - 12, g)
                                               for t in range(nT)]) for b in range(B)])
            when = None if rnd % 4 == 0 else torch.tensor([bool(rnd % 5)])
            want = R.reseat_slots(sp_r, wanted, phys, tb_r, heads, H, 0, when)
            got = reseat_slots(sp_t, wanted[:, :, :], phys, tb_t, heads, H, 0, when)
            assert torch.equal(sp_t, sp_r), rnd
            assert torch.equal(tb_t[:-1], tb_r[:-1]), rnd  # the spare entry is scratch
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rnd
            if rnd % 3 == 2:  # a new page (never wanted yet) into every row's first free slot, as decode does
                for sp, tb in states:
                    R.place_page(sp, phys, tb, heads, H, torch.tensor([cap - 1 - rnd]), sp.new_zeros(B, nT))

    def test_reseat_slots_strided_wanted_and_the_reference_past_its_limit(monkeypatch):
        """Wanted rows as views with strides (every other head of a selection; its page axis strided too), and rows
        longer than ``MAX_PAGES`` (here lowered), which the reference serves: the reference's result."""
        from flexicache_hf.kernels import slots

        g = torch.Generator().manual_seed(5)
        B, H, nT, S, K, cap = 2, 4, 2, 19, 16, 60
        heads = torch.tensor([1, 3])
        phys = (1 + torch.randperm(B * nT * S, generator=g)).view(B, nT, S)
        for limit in (slots.MAX_PAGES, 8):
            monkeypatch.setattr(slots, "MAX_PAGES", limit)
            ref = [torch.full((B, nT, S), -1, dtype=torch.long), torch.zeros(B * H * cap + 1, dtype=torch.int32)]
            ours = [t.clone() for t in ref]
            for rnd in range(3):
                sel = torch.rand(B, H, cap, generator=g).topk(K, dim=-1).indices.sort(-1).values
                if rnd == 1:
                    sel = sel.transpose(1, 2).contiguous().transpose(1, 2)
                wanted = sel[:, 1::2]
                want = R.reseat_slots(ref[0], wanted, phys, ref[1], heads, H, 0)
                got = slots.reseat_slots(ours[0], wanted, phys, ours[1], heads, H, 0)
                assert all(torch.equal(a, b) for a, b in zip((*got, ours[0], ours[1][:-1]),
                                                             (*want, ref[0], ref[1][:-1]))), (limit, rnd)

    @pytest.mark.parametrize("S", [1, 5, 17])
    def test_place_page_matches_reference(S):
        """A new page into each (row, slot head)'s first free slot, the table and the tail: the reference's result,
        with and without the predicate (off: nothing changes), and in a row without a free slot (nothing changes)."""
        g = torch.Generator().manual_seed(S)
        B, H, nT, cap = 3, 4, 2, 50
        heads = torch.tensor([3, 1])
        phys = (7 + torch.arange(B * nT * S)).view(B, nT, S)
        for rnd in range(10):
            sp = torch.randint(0, cap, (B, nT, S), generator=g)
            free = torch.rand(B, nT, S, generator=g) < 0.4
            free[..., int(torch.randint(0, S, (1,), generator=g))] = True  # a free slot in every row ...
            if rnd % 4 == 3:
                free[1, 0] = False  # ... but one: it changes nothing there (the layer never lets that happen)
            sp[free] = -1
            tb = torch.randint(0, 9, (B * H * cap + 1,), generator=g, dtype=torch.int32)
            tail = torch.randint(0, 9, (B, nT), generator=g)
            page = torch.tensor([int(torch.randint(0, cap, (1,), generator=g))])
            when = None if rnd % 3 == 0 else torch.tensor([bool(rnd % 2)])
            ref = (sp.clone(), tb.clone(), tail.clone())
            R.place_page(ref[0], phys, ref[1], heads, H, page, ref[2], when)
            place_page(sp, phys, tb, heads, H, page, tail, when)
            assert torch.equal(sp, ref[0]) and torch.equal(tail, ref[2]), rnd
            assert torch.equal(tb[:-1], ref[1][:-1]), rnd  # the spare entry is scratch

    # ---- a model's decode through the Triton kernels --------------------------------------------------------
    @pytest.mark.parametrize("ps,R", [(8, 16), (4, 4)])
    def test_qwen_geometry_decode_through_triton_kernels_matches_reference(ps, R, monkeypatch):
        """A tiny Qwen2 (7 query heads per KV head, 2 KV heads, one of them stable and offloaded), a prompt that
        ends on a page boundary, 2R + 3 greedy tokens: FlexiCache with the Triton kernels (interpreted; the tier
        copies, which need a GPU, stay the reference's) decodes the reference's tokens with the same logits.  At
        8-token pages and R = 16 the first interval starts three pages, which each need a device slot."""
        import dataclasses

        import flexicache_hf
        import flexicache_hf.layer.face as layer_module
        from flexicache_hf.kernels import REFERENCE_OPS
        from transformers import AutoModelForCausalLM, Qwen2Config

        cfg = Qwen2Config(vocab_size=64, hidden_size=14 * 16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache").eval()
        triton_ops = dataclasses.replace(
            TRITON_OPS, name="reference", minmax_update=minmax_update, copy_pages=REFERENCE_OPS.copy_pages,
            copy_kv_pages=REFERENCE_OPS.copy_kv_pages, copy_rows=REFERENCE_OPS.copy_rows)
        ids = torch.randint(0, 64, (1, 12 * ps))
        profile = flexicache_hf.HeadProfile.from_unstable(cfg, [(0, 0), (1, 1)])
        outs = {}
        for name, ops in (("reference", REFERENCE_OPS), ("triton", triton_ops)):
            monkeypatch.setattr(layer_module, "ops_for", lambda device, prefer=None, ops=ops: ops)
            cache = flexicache_hf.FlexiCache(profile, page_size=ps, token_budget=4 * ps, rerank_interval=R)
            with torch.no_grad():
                outs[name] = model.generate(ids, max_new_tokens=2 * R + 3, min_new_tokens=2 * R + 3, do_sample=False,
                                            past_key_values=cache, output_logits=True, return_dict_in_generate=True)
            assert cache.layers[0].storage.pool.layout.slots == 4 + R // ps + 1
        assert torch.equal(outs["reference"].sequences, outs["triton"].sequences)
        for a, b in zip(outs["reference"].logits, outs["triton"].logits):
            assert rel_err(b, a) < 1e-4

    # ---- page_lse --------------------------------------------------------------------------------------
    def lse_problem(group, D, ps, dtype, L, seed):
        """Two rows, 3 KV heads of ``group`` query heads, ``L`` tokens of keys in a shuffled pool with 3 spare pages
        of capacity per row and head, row 1 left-padded past its first page: ``(q, k_pool, table, valid_lo,
        pages, pool size, tolerance)``."""
        g = torch.Generator().manual_seed(seed)
        B, H = 2, 3
        n = -(-L // ps)
        cap = n + 3
        N = 1 + B * H * cap + 3
        k_pool = torch.randn(N, ps, D, generator=g).to(dtype)
        table = (1 + torch.randperm(N - 1, generator=g)[: B * H * cap]).view(B, H, cap).int()
        q = torch.randn(B, H * group, D, generator=g).to(dtype)
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        return q, k_pool, table, torch.tensor([0, ps + 3]), n, N, tol

    @pytest.mark.parametrize("group,D,ps,dtype", [(1, 8, 4, torch.float32), (3, 16, 8, torch.bfloat16),
                                                  (7, 64, 8, torch.float32), (7, 16, 4, torch.bfloat16),
                                                  (3, 64, 4, torch.float32), (1, 64, 8, torch.bfloat16)])
    def test_page_lse_matches_reference(group, D, ps, dtype):
        """Every page's log-sum-exp per query head: a shuffled table with unused capacity (entries past the page
        count point outside the pool: never dereferenced), a row left-padded past its first page, a partly filled
        last page (and, at the shorter length, a last page with no token yet), heads a subset out of order."""
        B, L = 2, 5 * ps + 3
        q, k_pool, table, valid_lo, n, N, tol = lse_problem(group, D, ps, dtype, L, seed=group * 100 + D + ps)
        cap, scale = table.shape[2], D ** -0.5
        # (pages, length): the decode step's; a last page with no token yet; a page count short of the length
        for count, length in ((n, L), (n, (n - 1) * ps), (n - 2, L)):
            tbl = table.clone()
            tbl[:, :, count:] = N + 10**6  # past num_pages: would fault if read
            num_pages, seq_len = torch.tensor([count]), torch.tensor([length])
            for heads in (torch.tensor([1]), torch.tensor([2, 0])):
                ref = R.page_lse(q, k_pool, tbl, heads, num_pages, valid_lo, seq_len, scale)
                for block_n in (None, 16, 128):  # 128: the tile of launches over >= 16 (row, head) pairs
                    ours = page_lse(q, k_pool, tbl, heads, num_pages, valid_lo, seq_len, scale, block_n=block_n)
                    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (B, heads.numel(), group, cap)
                    ours = live_part(ours, num_pages)
                    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (count, length, heads, block_n)
                    assert bool(torch.isneginf(ours[1, :, :, 0]).all())  # row 1's first page: all padding
                    fin = torch.isfinite(ref)
                    torch.testing.assert_close(ours[fin], ref[fin], **tol)
        from flexicache_hf.kernels.page_lse import _tile

        assert (_tile(8, 15), _tile(8, 16), _tile(256, 16)) == (64, 128, 256)
        assert page_lse(q, k_pool, table, torch.tensor([], dtype=torch.long), torch.tensor([n]), valid_lo,
                        torch.tensor([L]), scale).shape == (B, 0, group, cap)
        empty = page_lse(q[:0], k_pool, table[:0], torch.tensor([0]), torch.tensor([n]), valid_lo[:0],
                         torch.tensor([L]), scale)
        assert empty.shape == (0, 1, group, cap)

    @pytest.mark.parametrize("group,D,ps,dtype", [(1, 8, 4, torch.float32), (3, 16, 8, torch.bfloat16),
                                                  (7, 64, 8, torch.float32)])
    def test_page_lse_of_candidate_pages_matches_reference(group, D, ps, dtype):
        """Only listed pages scored (in any order, -1 padded, some past the page count): their log-sum-exps at
        their own columns, -inf everywhere else; a page past the count or unlisted is never read."""
        B, L = 2, 7 * ps + 1
        q, k_pool, table, valid_lo, n, N, tol = lse_problem(group, D, ps, dtype, L, seed=group * 10 + D + ps)
        cap, scale = table.shape[2], D ** -0.5
        table[:, :, n:] = N + 10**6  # past num_pages: would fault if read
        num_pages, seq_len = torch.tensor([n]), torch.tensor([L])
        heads = torch.tensor([2, 0])
        cand = torch.full((B, 2, 5), -1, dtype=torch.long)
        cand[0, 0, :3] = torch.tensor([n - 1, 0, 4])
        cand[0, 1, :5] = torch.tensor([1, 2, 3, n + 1, n - 1])  # one past the page count: -inf, not read
        cand[1, 0, :2] = torch.tensor([0, 5])  # row 1's page 0: all padding
        cand[1, 1, :4] = torch.tensor([6, 2, n - 1, 3])
        ref = R.page_lse(q, k_pool, table, heads, num_pages, valid_lo, seq_len, scale, cand)
        full = R.page_lse(q, k_pool, table, heads, num_pages, valid_lo, seq_len, scale)
        for block_n in (None, 16):
            ours = page_lse(q, k_pool, table, heads, num_pages, valid_lo, seq_len, scale, cand, block_n=block_n)
            assert ours.shape == ref.shape == (B, 2, group, cap)
            assert torch.equal(torch.isinf(ours), torch.isinf(ref))
            fin = torch.isfinite(ref)
            torch.testing.assert_close(ours[fin], ref[fin], **tol)
            torch.testing.assert_close(ours[fin], full[fin], **tol)  # a listed page's value is its full one
        assert int(torch.isfinite(ref[:, :, 0]).sum()) == (cand >= 0).logical_and(cand < n).sum() - 1  # (row 1's pad)

    @pytest.mark.parametrize("programs", [1, 16])
    def test_capped_grids_stride_over_their_blocks(monkeypatch, programs):
        """With the grid capped below the blocks of a row (1, or 2-4 programs per row), each program strides over the
        row's blocks: page scores (a group maximum and per-head bounds, inactive heads, blocks past the count) and
        page log-sum-exps (every page, and candidates) equal the reference's on the live part (candidates: -inf on
        every other live page too)."""
        from flexicache_hf.kernels import _util

        monkeypatch.setattr(_util, "ROW_PROGRAMS", programs)
        q, kmin, kmax, n = decode_step_scores_inputs(6)
        H = kmin.shape[1]
        active = torch.tensor([False, True, True, True])
        for combine in ("max", "mass"):
            ref = R.page_scores(q, kmin, kmax, torch.arange(H), n, active, combine)
            ours = live_part(page_scores(q, kmin, kmax, torch.arange(H), n, active, combine, block_p=4), n, active)
            assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
            fin = torch.isfinite(ref)
            torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-5, atol=1e-4)
        ps, L = 4, 9 * 4 + 1
        q, k_pool, table, valid_lo, n, N, tol = lse_problem(3, 16, ps, torch.float32, L, seed=11)
        table[:, :, n:] = N + 10**6  # past num_pages: would fault if read
        args = (q, k_pool, table, torch.tensor([2, 0]), torch.tensor([n]), valid_lo, torch.tensor([L]), 0.25)
        cand = torch.tensor([[[n - 1, 0, 4, -1, 7, 2], [1, 2, 3, n + 1, 8, -1]],
                             [[0, 5, 9, 6, 1, 3], [6, 2, n - 1, 3, -1, -1]]])
        for c in (None, cand):
            ref = R.page_lse(*args, c)
            ours = live_part(page_lse(*args, c, block_n=8), n)
            assert torch.equal(torch.isinf(ours), torch.isinf(ref))
            fin = torch.isfinite(ref)
            torch.testing.assert_close(ours[fin], ref[fin], **tol)

    # ---- group_mass ------------------------------------------------------------------------------------
    def mass_scores(B, h, G, P, seed):
        """Per-query-head scores with -inf holes, one row with nothing scorable, one query head with nothing
        scorable in another row, and one page no query head scores."""
        g = torch.Generator().manual_seed(seed)
        s = torch.randn(B, h, G, P, generator=g) * 4
        s[torch.rand(B, h, G, P, generator=g) < 0.3] = float("-inf")
        s[0, 1] = float("-inf")
        s[1, 0, 0] = float("-inf")
        s[1, h - 1, :, 3] = float("-inf")
        return s

    def assert_mass_equal(ours, ref):
        assert ours.dtype == torch.float32 and ours.shape == ref.shape and not ours.isnan().any()
        assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
        fin = torch.isfinite(ref)
        torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-5, atol=1e-7)

    @pytest.mark.parametrize("G", [1, 4, 7])
    @pytest.mark.parametrize("P", [37, 100])
    def test_group_mass_matches_reference(G, P):
        """Tiles of 16 pages (P not a multiple: a partial last block), the page count short of the row, past it
        or absent, inactive rows (nothing read: NaN there would show), a non-contiguous view."""
        from flexicache_hf.kernels.mass import group_mass

        B, h = 2, 3
        s = mass_scores(B, h, G, P, seed=G * 1000 + P)
        active = torch.tensor([True, False, True])
        poisoned = s.clone()
        poisoned[:, 1] = float("nan")  # the inactive row's scores
        for count in (None, P - 17, P, P + 5, 1, 0):
            n = None if count is None else torch.tensor([count])
            for act in (None, active):
                ref = R.group_mass(s, 0.7, n, act)
                for block_p in (None, 16):
                    ours = group_mass(s if act is None else poisoned, 0.7, n, act, block_p=block_p)
                    assert_mass_equal(live_part(ours, P if count is None else count, act), ref)
        assert bool(torch.isneginf(R.group_mass(s, 0.7)[0, 1]).all())  # a row with nothing scorable
        view = s.transpose(2, 3).contiguous().transpose(2, 3)  # pages the outer stride
        assert_mass_equal(group_mass(view, 1.3, torch.tensor([P - 2]), block_p=16),
                          R.group_mass(s, 1.3, torch.tensor([P - 2])))
        assert group_mass(s[:, :0], 0.7).shape == (B, 0, P)

    def test_group_mass_is_what_the_triton_backend_and_its_callers_use():
        """KernelOps.group_mass, the "mass" page scores and the exact mass (page_lse + group_mass) on the Triton
        backend equal the reference's."""
        from flexicache_hf.kernels import REFERENCE_OPS
        from flexicache_hf.kernels.mass import group_mass

        assert TRITON_OPS.group_mass is group_mass
        g = torch.Generator().manual_seed(9)
        B, H, G, D, ps, L = 2, 3, 4, 16, 4, 29
        n = -(-L // ps)
        cap, N = n + 3, 1 + B * H * (n + 3)
        k_pool = torch.randn(N, ps, D, generator=g)
        table = (1 + torch.randperm(N - 1, generator=g)).view(B, H, cap).int()
        q = torch.randn(B, H * G, D, generator=g)
        args = (q, k_pool, table, torch.tensor([2, 0, 1]), torch.tensor([n]), torch.tensor([0, 5]), torch.tensor([L]))
        active = torch.tensor([True, False, True])
        got = [R.exact_page_mass(*args, 0.25, active, lse=ops.page_lse, mass=ops.group_mass)
               for ops in (TRITON_OPS, REFERENCE_OPS)]
        assert_mass_equal(live_part(got[0], n, active), got[1])

    @pytest.mark.parametrize("capacity", [-1, 11])
    @pytest.mark.parametrize("overlap", [False, True])
    def test_schedule_kernels_match_reference_step_by_step(capacity, overlap):
        from flexicache_hf.kernels.schedule import begin_layer, plan_step

        schedule_steps_agree(plan_step, begin_layer, "cpu", capacity, overlap)
