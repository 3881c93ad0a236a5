"""Structure of a Triton kernel's machine code, checked without a GPU: the kernel is compiled for an sm_90 target
(Triton's own LLVM and ptxas) and its PTX read.

The prompt's MinMax update once reduced each page's tokens across warps (71 barriers and 256 shuffles per program)
and ran at ~10 % of the H200's bandwidth; the rewrite keeps the reduction in each thread's registers
(``docs/benchmarks/decode.md``). This guards that structure where the GPU cannot be reached.
"""

import re

import pytest

triton = pytest.importorskip("triton")

from flexicache_hf.kernels._util import interpreting  # noqa: E402 - after the skip without Triton

if interpreting():
    pytest.skip("TRITON_INTERPRET=1 defines the kernels as interpreter functions, which Triton does not compile "
                "to PTX", allow_module_level=True)


def ptx_of(kernel, signature: dict, constexprs: dict, num_warps: int, aligned: tuple[str, ...]) -> str:
    """PTX of ``kernel`` for sm_90; ``aligned``: the arguments a launch sees as multiples of 16 (Triton specialises
    pointers and integers on that at run time), pointers always."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(signature.items())
             if t.startswith("*") or name in aligned}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton build has no CUDA backend")
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return compiled.asm["ptx"]


def test_prompt_minmax_reduces_in_registers_with_wide_independent_loads():
    from flexicache_hf.kernels.minmax import UNROLL_TOKENS, _minmax_update_kernel

    sig = {"kmin_ptr": "*fp16", "kmax_ptr": "*fp16", "keys_ptr": "*fp16", "valid_lo_ptr": "*i64", "start": "i32",
           "T": "i32", "H": "i32", "s_mb": "i32", "s_mh": "i32", "s_mp": "i32", "s_md": "constexpr",
           "s_kb": "i32", "s_kh": "i32", "s_kt": "i32", "s_kd": "constexpr", "D": "constexpr",
           "BLOCK_D": "constexpr", "PAGE_SIZE": "constexpr", "PAGES": "constexpr", "UNROLL": "constexpr"}
    # The launch of a long chunk at Llama's geometry: 8 pages of 16 tokens, D = 128, contiguous channels.
    const = {"s_md": 1, "s_kd": 1, "D": 128, "BLOCK_D": 128, "PAGE_SIZE": 16, "PAGES": 8, "UNROLL": UNROLL_TOKENS}
    # Strides of [B, H, P, 128] MinMax and [B, H, T, 128] keys (or HF's transposed view): multiples of 16.
    ptx = ptx_of(_minmax_update_kernel, sig, const, num_warps=4,
                 aligned=("s_mb", "s_mh", "s_mp", "s_kb", "s_kh", "s_kt"))
    assert "bar.sync" not in ptx and "shfl" not in ptx  # no cross-thread reduction
    wide = re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx)
    assert len(wide) >= UNROLL_TOKENS  # every token of a group: one 16-byte load per thread, all independent
    assert "st.global.v4.b32" in ptx  # the folded MinMax rows are written 16 bytes at a time


@pytest.mark.parametrize("mapped", [False, True])
def test_select_is_one_kernel_for_every_width_without_spills(mapped):
    """The select walks a row's live pages in blocks: rows reserved for 16k or 128k pages launch the kernel of a 2k
    row (the old in-register select spilled at 16k), with no local-memory spills; also as the split scoring launches
    it (rows into mapped heads, the stable heads' margin scaled in place behind a barrier)."""
    from flexicache_hf.kernels.select import _select_pages_kernel, launch_config

    assert launch_config(2049) == launch_config(16384) == launch_config(131072) == (1024, 8)
    assert launch_config(40) == (64, 1)
    sig = {"scores_ptr": "*fp32", "out_ptr": "*i64", "num_pages_ptr": "*i64", "active_ptr": "*i1",
           "heads_ptr": "*i64", "keep_ptr": "*i1", "margin": "fp32", "K": "i32", "h": "i32", "H_out": "i32",
           "s_sr": "i32", "HEAD_MAP": "constexpr", "KEEP": "constexpr", "KEEP_ROWS": "constexpr",
           "BLOCK": "constexpr", "BLOCK_K": "constexpr"}
    flags = {"HEAD_MAP": mapped, "KEEP": mapped, "KEEP_ROWS": False}
    ptx = ptx_of(_select_pages_kernel, sig, {"BLOCK": 1024, "BLOCK_K": 256, **flags}, num_warps=8,
                 aligned=("s_sr",))
    if mapped:
        assert "bar.sync" in ptx  # the scaled scores are in place before the walks read them
    assert ".local" not in ptx  # every block's keys, the histogram and the prefix sums stay in registers / shared


def test_group_mass_compiles_for_sm90_without_spills():
    """The "mass" combine at Llama-8B's group (G = 4) as the wrapper launches it: it compiles for sm_90 (the
    interpreter accepts what the compiler refuses, e.g. a global float read in the kernel) and keeps its
    4096-score tiles in registers."""
    from flexicache_hf.kernels.mass import TILE_ELEMENTS, _group_mass_kernel

    sig = {"s_ptr": "*fp32", "out_ptr": "*fp32", "num_pages_ptr": "*i64", "active_ptr": "*i1", "scale": "fp32",
           "width": "i32", "n_sel": "i32", "s_sb": "i32", "s_sh": "i32", "s_sg": "i32", "s_sp": "constexpr",
           "GROUP": "constexpr", "G_PAD": "constexpr", "BLOCK_P": "constexpr"}
    const = {"s_sp": 1, "GROUP": 4, "G_PAD": 4, "BLOCK_P": TILE_ELEMENTS // 4}
    ptx = ptx_of(_group_mass_kernel, sig, const, num_warps=4, aligned=("s_sb", "s_sh", "s_sg"))
    assert "ld.local" not in ptx and "st.local" not in ptx  # no register spills
    assert "ex2.approx" in ptx  # the softmax's exponentials on the SFU


def launch_key(kernel, call, monkeypatch) -> str:
    """The compiled variant (Triton's specialisation of every argument, for an sm_90 target) that ``call()``'s
    one launch of ``kernel`` would run, found without launching it: the launch is caught at ``kernel.run``."""
    keys = launch_keys(kernel, call, monkeypatch)
    assert len(keys) == 1
    return keys[0]


def launch_keys(kernel, call, monkeypatch) -> list[str]:
    """:func:`launch_key` of each of ``call()``'s launches of ``kernel``, in order."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    keys = []

    def run(*args, grid, warmup, **kwargs):
        _, specialization, options = binder(*args, **kwargs)
        keys.append(f"{specialization} {options}")

    monkeypatch.setattr(kernel, "run", run)
    call()
    return keys


def test_calls_with_and_without_a_predicate_launch_one_variant(monkeypatch):
    """A prompt's reseat / page placement (no predicate) and a compiled step's (the layer's flag, a slice of the
    schedule's flags at any byte) run the same compiled variant: each variant is a compile in a machine's first
    process (the reseat's sort ~1-2 s of it)."""
    import torch

    from flexicache_hf.kernels import slots

    B, nT, S, K, H, cap = 2, 3, 40, 32, 4, 64
    slot_page = torch.full((B, nT, S), -1, dtype=torch.long)
    slot_phys = torch.arange(B * nT * S, dtype=torch.long).view(B, nT, S)
    table = torch.zeros(B * H * cap + 1, dtype=torch.int32)
    heads = torch.tensor([0, 2, 3])
    wanted = torch.arange(B * nT * K, dtype=torch.long).view(B, nT, K) % cap
    flags = torch.ones(5, dtype=torch.bool)
    tail = torch.zeros(B, nT, dtype=torch.long)
    page = torch.tensor([7])
    reseat = [launch_key(slots._reseat_kernel, lambda w=w: slots.reseat_slots(
        slot_page, wanted, slot_phys, table, heads, H, B * H * cap, w), monkeypatch) for w in (None, flags[3:4])]
    place = [launch_key(slots._place_page_kernel, lambda w=w: slots.place_page(
        slot_page, slot_phys, table, heads, H, page, tail, w), monkeypatch) for w in (None, flags[1:2])]
    assert reseat[0] == reseat[1] and place[0] == place[1]


def test_flags_at_any_byte_launch_one_variant(monkeypatch):
    """The row flags of the mass combine and the select (read one scalar at a time) at an aligned or unaligned
    address: one variant."""
    import torch

    from flexicache_hf.kernels import mass, select

    scores = torch.randn(2, 3, 4, 64)
    flags = torch.ones(8, dtype=torch.bool)
    keys = [launch_key(mass._group_mass_kernel, lambda a=a: mass.group_mass(scores, 0.5, active=a), monkeypatch)
            for a in (flags[:3], flags[1:4])]
    assert keys[0] == keys[1]
    out = torch.full((2, 5, 8), -1, dtype=torch.long)
    picks = [launch_key(select._select_pages_kernel, lambda a=a, h=h: select.select_pages(
        scores[:, :, 0].contiguous(), 8, active=a, out=out, heads=h, keep_margin=1.0, keep=a), monkeypatch)
        for a, h in ((flags[:3], torch.arange(5)[:3]), (flags[1:4], torch.arange(5)[1:4]))]
    assert picks[0] == picks[1]


def test_every_layer_launches_one_variant_of_the_exact_mass(monkeypatch):
    """Layers differ in how many heads of a kind they hold (the profile's unstable heads) and where those heads' ids
    sit: the exact mass's log-sum-exps and its combine launch one variant for all of them (the combine's strides,
    ``h * G * width``, are multiples of 16 in some layers only)."""
    import torch

    from flexicache_hf.kernels import mass, page_lse

    B, H, G, D, ps, width = 8, 8, 4, 16, 8, 65
    q = torch.randn(B, H * G, D, dtype=torch.float16)
    k_pool = torch.randn(B * H * width, ps, D, dtype=torch.float16)
    table = torch.arange(B * H * width, dtype=torch.int32).view(B, H, width)
    ids = torch.arange(H)
    scalars = (torch.tensor([width]), torch.zeros(B, dtype=torch.long), torch.tensor([width * ps]))
    lse = [launch_key(page_lse._page_lse_kernel, lambda h=h: page_lse.page_lse(
        q, k_pool, table, h, scalars[0], scalars[1], scalars[2], 0.25), monkeypatch) for h in (ids[2:4], ids[5:7])]
    assert lse[0] == lse[1]
    combine = [launch_key(mass._group_mass_kernel, lambda h=h: mass.group_mass(
        torch.randn(B, h, G, width), 0.5), monkeypatch) for h in (1, 4)]
    assert combine[0] == combine[1]


def test_a_prompts_select_and_a_steps_launch_one_variant(monkeypatch):
    """A prompt's select (rows as wide as its pages, a multiple of 16 at 16k) and a compiled step's (rows as wide as
    the capacity, 16k + 1 pages) into the heads of a layer's selection: one variant."""
    import torch

    from flexicache_hf.kernels import select

    out = torch.full((2, 8, 128), -1, dtype=torch.long)
    heads = torch.tensor([1, 4, 6])
    keys = [launch_key(select._select_pages_kernel, lambda w=w: select.select_pages(
        torch.randn(2, 3, w), 128, out=out, heads=heads), monkeypatch) for w in (2048, 2049)]
    assert keys[0] == keys[1]


def test_a_layer_of_one_kind_of_head_selects_with_a_mixed_layers_variants(monkeypatch):
    """Profiles leave some layers with no unstable head (7 of Llama-3.1-8B's 32): their one select (every head by one
    rule, with the stable heads' margin) runs the variant of a mixed layer's stable select, and an all-unstable
    layer's that of a mixed layer's unstable select."""
    import dataclasses

    import torch

    from flexicache_hf.kernels import REFERENCE_OPS, select
    from flexicache_hf.rerank import Reranker

    ops = dataclasses.replace(REFERENCE_OPS, select_pages=select.select_pages)
    g = torch.Generator().manual_seed(0)
    q, lo = torch.randn(2, 12, 8, generator=g), torch.randn(2, 4, 40, 8, generator=g)
    hi = lo + 1

    def selects(unstable):
        r = Reranker(2, 4, unstable, 4, 1, torch.device("cpu"), stable_scoring=("mass", 0.5),
                     unstable_scoring=("max", 1.0), keep_margin=1.0)
        return launch_keys(select._select_pages_kernel, lambda: r.rerank(
            ops, q, lo, hi, torch.tensor([40]), due=torch.tensor(True), scale=0.3), monkeypatch)

    stable, unstable = selects((1, 3))  # a mixed layer: each kind selected on its own
    assert stable != unstable
    assert selects(()) == [stable] and selects((0, 1, 2, 3)) == [unstable]
