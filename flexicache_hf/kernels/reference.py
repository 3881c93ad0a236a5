"""Plain PyTorch reference for every FlexiCache kernel.

These functions are the CPU path and the oracle the Triton / cuda-python kernels are tested against.
They define the contract (shapes, dtypes, padding conventions) every backend implements:

* Pages hold ``page_size`` consecutive tokens of one (sequence, KV head).  Logical page ``p`` of a
  sequence covers token positions ``[p * page_size, (p + 1) * page_size)``.
* A token position ``t`` of batch row ``b`` is *valid* iff ``valid_lo[b] <= t < seq_len``: rows are
  left-padded (HF's convention for decoder-only generation), so padding is a prefix.
* Page lists use ``-1`` for "no page" so every tensor keeps a fixed width (no host syncs).
* The device page pool is ``[num_physical_pages, page_size, head_dim]``; ``page_table[b, h, p]`` is the
  physical page of logical page ``p``; physical page 0 is the *null page* (never dereferenced).
* The MinMax cache ``kmin`` / ``kmax`` is ``[B, H, P_cap, D]`` with any strides (the cache passes views of its
  page-major ``[P_cap, B, H, D]`` storage); every backend addresses it through its strides.
* The live part: a per-page output row given a device page count (``page_scores``, ``page_lse``, ``group_mass``)
  is as wide as the cache's capacity, and the reference stores ``-inf`` past the count and on rows not active.
  Every caller reads only the pages that exist of the active rows (``select_pages`` with ``num_pages`` and
  ``active``), so a backend may leave the rest unwritten: a reserved row (an unsized cache's, as wide as the model's
  context) then costs its live pages, not its width.
"""

from __future__ import annotations

import torch

from ..config import GROUP_SCORES
from .reference_copies import (copy_block, copy_kv_pages, copy_pages, copy_rows, join_loads,  # noqa: F401
                               load_pages_behind)

NEG_INF = float("-inf")


def host_int(x: torch.Tensor | int) -> int:
    """A count the kernels take as a one-element device tensor (graph replays read the current value) or an int."""
    return int(x.reshape(-1)[0]) if isinstance(x, torch.Tensor) else x


def minmax_update(
    kmin: torch.Tensor,  # [B, H, P_cap, D] running per-page per-channel key minimum (+inf = empty)
    kmax: torch.Tensor,  # [B, H, P_cap, D] running per-page per-channel key maximum (-inf = empty)
    keys: torch.Tensor,  # [B, H, T, D] keys of positions start .. start + T - 1
    start: int,
    valid_lo: torch.Tensor,  # [B] first valid (non-padding) position of each row
    page_size: int,
) -> None:
    """Fold new keys into the MinMax cache in place; padding tokens are ignored.

    Pages are folded incrementally (min/max are associative), so a page's entry is exact once it is full
    and an exact bound of its valid tokens at every point before.
    """
    B, H, T, D = keys.shape
    pos = torch.arange(start, start + T, device=keys.device)
    valid = pos[None, :] >= valid_lo[:, None]  # [B, T]
    first_page, last_page = start // page_size, (start + T - 1) // page_size
    n = last_page - first_page + 1
    # Scatter into a padded [.., n * page_size, ..] window so every page reduces over a fixed shape.
    off = start - first_page * page_size
    k = keys.float()
    big = torch.finfo(torch.float32).max
    lo = torch.full((B, H, n * page_size, D), big, device=keys.device)
    hi = torch.full((B, H, n * page_size, D), -big, device=keys.device)
    v = valid[:, None, :, None]
    lo[:, :, off : off + T] = torch.where(v, k, big)
    hi[:, :, off : off + T] = torch.where(v, k, -big)
    lo = lo.view(B, H, n, page_size, D).amin(3)
    hi = hi.view(B, H, n, page_size, D).amax(3)
    # Pages with no valid token keep +inf/-inf (their sentinel) instead of the finite stand-in.
    any_valid = hi > -big
    cur_min = kmin[:, :, first_page : last_page + 1].float()
    cur_max = kmax[:, :, first_page : last_page + 1].float()
    kmin[:, :, first_page : last_page + 1] = torch.where(any_valid, torch.minimum(cur_min, lo), cur_min).to(kmin.dtype)
    kmax[:, :, first_page : last_page + 1] = torch.where(any_valid, torch.maximum(cur_max, hi), cur_max).to(kmax.dtype)


def append_token(
    k_pool: torch.Tensor,  # [num_physical, page_size, D]
    v_pool: torch.Tensor,
    kmin: torch.Tensor,  # [B, H, P_cap, D]
    kmax: torch.Tensor,
    key: torch.Tensor,  # [B, H, D] the decode token's keys
    value: torch.Tensor,  # [B, H, D]
    rows: torch.Tensor,  # [B, H] int64 physical row (physical page * page_size + offset) of each (row, head)
    page: torch.Tensor,  # [1] int64 logical page the token belongs to
) -> None:
    """Store one decode token per (row, KV head) at its physical pool row and fold its key into the MinMax
    entry of logical ``page`` (in place).  Decode tokens are never padding, so every one is folded."""
    B, H, D = key.shape
    flat = rows.reshape(-1)
    k_pool.view(-1, D).index_copy_(0, flat, key.reshape(-1, D).to(k_pool.dtype))
    v_pool.view(-1, D).index_copy_(0, flat, value.reshape(-1, D).to(v_pool.dtype))
    idx = page.view(1, 1, 1, 1).expand(B, H, 1, D)
    k = key[:, :, None].to(kmin.dtype)
    kmin.scatter_(2, idx, torch.minimum(kmin.gather(2, idx), k))
    kmax.scatter_(2, idx, torch.maximum(kmax.gather(2, idx), k))


def check_combine(combine: str) -> None:
    """``combine`` must name how a KV head's query-head group turns its bounds into one page score
    (:data:`~flexicache_hf.config.GROUP_SCORES`, FlexiCacheConfig.group_score)."""
    if combine not in GROUP_SCORES:
        raise ValueError(f"combine must be one of {GROUP_SCORES}, got {combine!r}")


def group_mass(
    scores: torch.Tensor,  # [B, h, G, P] float32 per query head; -inf = not scorable
    scale: float,  # applied to the scores before the softmax (1.0 for log-sum-exps of scaled logits)
    num_pages: torch.Tensor | None = None,  # [1] int64 pages that exist (None: P); entries past it are ignored
    active: torch.Tensor | None = None,  # [h] bool rows to combine (None: all); inactive rows are -inf
) -> torch.Tensor:  # [B, h, P] float32
    """Each query head's scores as an estimated attention distribution over the pages (``softmax_p(scale *
    score)``), summed over the KV head's group of query heads.

    The oracle's objective is the group's summed attention mass per page; a softmax per query head puts every
    head on the same footing (each contributes a distribution summing to 1), where the raw maximum lets the head
    with the largest query norm decide the ranking for the whole group.  A page no query head of the group can
    score, a page at or past ``num_pages`` and every page of an inactive row is -inf (here; a backend may leave
    those last two unwritten: the live part, see the module's docstring).
    """
    if num_pages is not None:  # pages past the count take no part (masked, not sliced: no host sync)
        p = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(p >= num_pages.to(scores.device).reshape(-1)[:1], NEG_INF)
    s = scores * scale
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(s - top)  # -inf -> 0
    mass = (e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)).sum(2)
    mass = mass.masked_fill(~torch.isfinite(scores).any(2), NEG_INF)
    if active is not None:
        mass = mass.masked_fill(~active.to(mass.device)[None, :, None], NEG_INF)
    return mass


def check_shrink(shrink: float) -> None:
    if not 0.0 <= shrink <= 1.0:
        raise ValueError(f"the bound's shrink must lie in [0, 1], got {shrink!r}")


def check_select_out(out: torch.Tensor | None, heads: torch.Tensor | None, keep_margin: float) -> None:
    """select_pages' ``heads`` and ``keep_margin`` act on ``out`` (the selection they map into / keep)."""
    if out is None and (heads is not None or keep_margin):
        raise ValueError("select_pages: heads and keep_margin need out (the selection they map into / keep)")


def narrowing(shrink: float) -> tuple[float, float]:
    """``(near, far)``: each end of the box ``c ± shrink * h`` is ``near`` times the same end of ``[lo, hi]`` plus
    ``far`` times the other (``c`` the centre, ``h`` the half-width; both kernels use these weights)."""
    return (1.0 + shrink) / 2, (1.0 - shrink) / 2


def narrowed(lo: torch.Tensor, hi: torch.Tensor, shrink: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The box ``c ± shrink * h`` of ``[lo, hi]``, as new ends (see :func:`narrowing`)."""
    near, far = narrowing(shrink)
    return near * lo + far * hi, near * hi + far * lo


def page_scores(
    query: torch.Tensor,  # [B, Hq, D] the decode step's queries
    kmin: torch.Tensor,  # [B, H, P_cap, D]
    kmax: torch.Tensor,  # [B, H, P_cap, D]
    heads: torch.Tensor,  # [h] int64 KV heads to score
    num_pages: int | torch.Tensor,  # pages that exist: an int, or a [1] int64 tensor (read on the device)
    active: torch.Tensor | None = None,  # [h] bool: heads scored now (None: all); inactive rows are -inf
    combine: str = "max",  # config.GROUP_SCORES: how the group's query heads make one score
    scale: float | None = None,  # the attention's softmax scale ("mass"; None: D ** -0.5)
    shrink: float = 1.0,  # FlexiCacheConfig.bound_shrink: the half-range's weight (1: Quest's bound)
) -> torch.Tensor:  # [B, h, num_pages] float32 for an int count, [B, h, P_cap] (-inf past the count) for a tensor
    """Quest's upper bound ``sum_i max(q_i * kmin_i, q_i * kmax_i)`` per page and query head, for the given KV
    heads, combined over each KV head's group of query heads.

    ``combine="max"`` (the paper's, Quest's): every query head bounds the page on its own and the group keeps
    the **maximum** bound, so a page any query head may need strongly is ranked high (a sum or mean would let
    the other heads of the group outvote it).  ``combine="mass"``: :func:`group_mass` of the bounds.  Pages
    without a valid token score ``-inf``.

    With ``c = (kmin + kmax) / 2`` and ``h = (kmax - kmin) / 2`` the bound is ``q . c + sum_i |q_i| h_i``;
    ``shrink`` < 1 weighs the half-range by ``shrink`` (an estimate, no longer an upper bound), computed as the
    same bound over the narrowed box ``c ± shrink * h``.
    """
    check_combine(combine)
    check_shrink(shrink)
    if isinstance(num_pages, torch.Tensor):  # the device count: a row as wide as the cache, -inf past it
        n = host_int(num_pages)
        out = torch.full((query.shape[0], heads.numel(), kmin.shape[2]), NEG_INF, device=query.device)
        out[:, :, :n] = page_scores(query, kmin, kmax, heads, n, active, combine, scale, shrink)
        return out
    B, Hq, D = query.shape
    H = kmin.shape[1]
    group = Hq // H
    q = query.float().view(B, H, group, D)[:, heads]  # [B, h, G, D]
    lo = kmin[:, heads, :num_pages].float()  # [B, h, P, D]
    hi = kmax[:, heads, :num_pages].float()
    empty = hi[..., 0] == NEG_INF  # [B, h, P]
    lo = torch.where(empty[..., None], 0.0, lo)
    hi = torch.where(empty[..., None], 0.0, hi)
    if shrink != 1.0:
        lo, hi = narrowed(lo, hi, shrink)
    qe = q[:, :, :, None, :]  # [B, h, G, 1, D]
    bound = torch.maximum(qe * lo[:, :, None], qe * hi[:, :, None]).sum(-1)  # [B, h, G, P]
    if combine == "max":
        score = bound.amax(2).masked_fill(empty, NEG_INF)
    else:
        score = group_mass(bound.masked_fill(empty[:, :, None], NEG_INF), D ** -0.5 if scale is None else scale)
    if active is not None:
        score = score.masked_fill(~active.to(score.device)[None, :, None], NEG_INF)
    return score


def page_lse(
    query: torch.Tensor,  # [B, Hq, D] the decode step's queries
    k_pool: torch.Tensor,  # [N, page_size, D] key pool
    page_table: torch.Tensor,  # [B, H, P_cap] int32 physical page of each logical page
    heads: torch.Tensor,  # [h] int64 KV heads to score (every page of theirs on the device)
    num_pages: torch.Tensor,  # [1] int64 pages that exist
    valid_lo: torch.Tensor,  # [B] int64 first non-padding position per row
    seq_len: torch.Tensor,  # [1] int64 tokens stored
    scale: float,  # the attention's softmax scale
    candidates: torch.Tensor | None = None,  # [B, h, C] int64 logical pages to score (-1 padded); None: every page
) -> torch.Tensor:  # [B, h, G, P_cap] float32
    """Each page's log-sum-exp of the exact attention logits ``scale * q . k`` over its valid tokens, per query
    head of the given KV heads' groups; ``-inf`` for pages past ``num_pages`` or without a valid token, and, given
    ``candidates``, for every page not among its row's and head's candidates (their keys need not be read).

    ``group_mass(page_lse(...), 1.0)`` is each KV head's exact attention mass per page, summed over its group:
    the oracle's ranking, for heads whose keys all stay on the device (the unstable ones).
    """
    B, Hq, D = query.shape
    H, P_cap = page_table.shape[1], page_table.shape[2]
    ps = k_pool.shape[1]
    G = Hq // H
    n, length = host_int(num_pages), host_int(seq_len)
    out = torch.full((B, heads.numel(), G, P_cap), NEG_INF, dtype=torch.float32, device=query.device)
    if n == 0 or heads.numel() == 0:
        return out
    phys = page_table[:, heads, :n].long()  # [B, h, n]
    k = k_pool[phys].float()  # [B, h, n, ps, D]
    q = query.float().view(B, H, G, D)[:, heads]  # [B, h, G, D]
    pos = torch.arange(n, device=query.device)[:, None] * ps + torch.arange(ps, device=query.device)  # [n, ps]
    ok = (pos[None] >= valid_lo[:, None, None]) & (pos[None] < length)  # [B, n, ps]
    logits = torch.einsum("bhgd,bhptd->bhgpt", q, k) * scale
    logits = logits.masked_fill(~ok[:, None, None], NEG_INF)
    out[..., :n] = torch.logsumexp(logits, dim=-1)
    if candidates is not None:
        keep = torch.zeros((B, heads.numel(), P_cap + 1), dtype=torch.bool, device=query.device)
        keep.scatter_(2, torch.where((candidates >= 0) & (candidates < P_cap), candidates, P_cap), True)  # spare column
        out = out.masked_fill(~keep[:, :, None, :P_cap], NEG_INF)
    return out


def exact_page_mass(query, k_pool, page_table, heads, num_pages, valid_lo, seq_len, scale: float | None = None,
                    active: torch.Tensor | None = None, lse=page_lse, mass=group_mass,
                    candidates: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, h, P_cap]``: the exact attention mass of each page summed over the KV head's group (a softmax per
    query head over every valid token of the head, the new one included), ``-inf`` where no token is valid and on
    inactive heads.  ``scale``: the attention's softmax scale (None: D ** -0.5, as :func:`page_scores`).
    ``lse`` / ``mass``: the :func:`page_lse` and :func:`group_mass` implementations (the reference's or a
    backend's: ``KernelOps.page_lse`` / ``KernelOps.group_mass``).  ``candidates`` ``[B, h, C]``: only these pages
    are scored (the softmax then runs over them; every other page ``-inf``)."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return mass(lse(query, k_pool, page_table, heads, num_pages, valid_lo, seq_len, scale, candidates), 1.0,
                num_pages, active)


def keep_selected(scores: torch.Tensor, selected: torch.Tensor, margin: float, rows: torch.Tensor | None = None):
    """In place: the scores ``[B, h, P]`` of each row's selected pages ``selected [B, h, K]`` (-1 padded) times
    ``1 + margin`` (``FlexiCacheConfig.keep_margin``), on the rows of heads ``rows [h]`` (bool; ``None``: every row).
    Gathers and scatters K entries a row, never the row's width; a pad entry rewrites its row's first selected page
    with the same value (a row selecting nothing rewrites page 0 unchanged), so no two writes of one page differ."""
    first = selected[..., :1]
    idx = torch.where(selected >= 0, selected, first).clamp_(min=0)
    factor = torch.where(first >= 0, 1.0 + margin, 1.0)
    factor = factor if rows is None else torch.where(rows[None, :, None], factor, 1.0)
    scores.scatter_(2, idx, scores.gather(2, idx) * factor)


def select_pages(
    scores: torch.Tensor,  # [B, h, P] float32; -inf = not selectable
    k: int,
    *,
    num_pages: torch.Tensor | None = None,  # [1] int64: rows hold this many pages (None: P)
    active: torch.Tensor | None = None,  # [h] bool: rows to select (with ``out``; None: all)
    out: torch.Tensor | None = None,  # [B, h, k] (with heads [B, H, k]) int64: the active rows written here
    heads: torch.Tensor | None = None,  # [h] int64 (with out): out's head of each row
    keep_margin: float = 0.0,  # (with out) a row's pages held in out now score (1 + m) x theirs, in place
    keep: torch.Tensor | None = None,  # [h] bool: the rows keep_margin applies to (None: all)
) -> torch.Tensor:  # [B, h, k] int64, ascending page ids, -1 padded at the end (``out`` when given)
    """Top-``k`` pages per (sequence, head), always keeping the last page (the one being appended to); fewer
    selectable pages than ``k``: all of them, then ``-1``.  ``out``: the active rows written there (row ``j`` into
    head ``heads[j]``), the rest left; ``keep_margin``: the stable heads' hysteresis (:func:`keep_selected` first)."""
    check_select_out(out, heads, keep_margin)
    if num_pages is not None:
        scores = scores[:, :, : host_int(num_pages)]
    if out is not None:
        h = scores.shape[1]
        act = torch.ones(h, dtype=torch.bool, device=out.device) if active is None else active.to(out.device)
        now = out if heads is None else out.index_select(1, heads)
        if keep_margin:
            keep_selected(scores, now, keep_margin, act if keep is None else act & keep)
        pages = torch.where(act[None, :, None], select_pages(scores, k).to(out.device), now)
        return out.copy_(pages) if heads is None else out.index_copy_(1, heads, pages)
    B, h, P = scores.shape
    s = scores.clone()
    s[:, :, P - 1] = float("inf")  # the page holding the newest token is always attended
    kk = min(k, P)
    val, idx = s.topk(kk, dim=-1)
    idx = torch.where(val == NEG_INF, torch.full_like(idx, P), idx)  # sort -1s to the end
    idx = idx.sort(-1).values
    idx = torch.where(idx == P, torch.full_like(idx, -1), idx)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((B, h, k - kk), -1)], dim=-1)
    return idx


def sparse_decode(
    query: torch.Tensor,  # [B, Hq, D]
    k_pool: torch.Tensor,  # [N, page_size, D]
    v_pool: torch.Tensor,  # [N, page_size, D]
    page_table: torch.Tensor,  # [B, H, P_cap] int32 physical page of each logical page
    pages: torch.Tensor,  # [B, H, W] int64 logical pages to attend (-1 = none); no duplicates
    valid_lo: torch.Tensor,  # [B] int64
    seq_len: int | torch.Tensor,  # tokens stored (an int or a [1] int64 tensor)
    scale: float,
) -> torch.Tensor:  # [B, Hq, D] in query dtype
    """Attention of one decode query per head over only the listed pages of its KV head.

    Softmax runs over exactly the valid tokens of the listed pages; each KV page is read once for all
    query heads of its group.  Lists may be wider than the pages that exist (a fixed ``budget`` width); the
    work follows the listed pages, at most ``ceil(seq_len / page_size)`` per head, not the width.
    """
    B, Hq, D = query.shape
    H, W = pages.shape[1], pages.shape[2]
    ps = k_pool.shape[1]
    group = Hq // H
    seq_len = host_int(seq_len)
    existing = -(-seq_len // ps)
    if W > existing:  # listed pages are distinct and < existing: the `existing` smallest entries hold them all
        keyed = torch.where(pages >= 0, pages, existing)
        pages = pages.gather(2, keyed.topk(existing, dim=-1, largest=False).indices)
        W = existing
    listed = pages >= 0
    logical = pages.clamp_min(0)
    phys = page_table.long().gather(2, logical)  # [B, H, W]
    k = k_pool[phys].float()  # [B, H, W, ps, D]
    v = v_pool[phys].float()
    pos = logical[..., None] * ps + torch.arange(ps, device=query.device)  # [B, H, W, ps]
    ok = listed[..., None] & (pos >= valid_lo[:, None, None, None]) & (pos < seq_len)
    q = query.float().view(B, H, group, D)
    logits = torch.einsum("bhgd,bhwtd->bhgwt", q, k) * scale
    logits = logits.masked_fill(~ok[:, :, None], NEG_INF).reshape(B, H, group, W * ps)
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no valid token (cannot happen) -> 0
    v = torch.where(ok[..., None], v, 0.0)  # unwritten slots may hold anything; 0 * NaN would be NaN
    out = torch.einsum("bhgn,bhnd->bhgd", p, v.reshape(B, H, W * ps, D))
    return out.reshape(B, Hq, D).to(query.dtype)


def set_table_entries(table_buffer: torch.Tensor, slot_heads: torch.Tensor, num_heads: int, pages: torch.Tensor,
                      phys: torch.Tensor) -> None:
    """``table[b, slot_heads[t], pages[b, t, i]] = phys[b, t, i]`` where ``pages >= 0`` (in place), in the flat page
    table ``table_buffer`` ``[B * num_heads * cap + 1]``; -1 entries land in its last, spare entry (one scatter,
    no masking)."""
    B = pages.shape[0]
    cap = (table_buffer.numel() - 1) // max(1, B * num_heads)
    b = torch.arange(B, device=pages.device)[:, None, None]
    h = slot_heads.to(pages.device)[None, :, None]
    idx = torch.where(pages >= 0, (b * num_heads + h) * cap + pages.clamp_min(0), table_buffer.numel() - 1)
    table_buffer[idx.reshape(-1)] = phys.reshape(-1).to(table_buffer.dtype)


def place_page(
    slot_page: torch.Tensor,  # [B, nT, S] int64 (updated in place)
    slot_phys: torch.Tensor,  # [B, nT, S] int64
    table_buffer: torch.Tensor,  # [B * H * cap + 1] int32 flat page table (updated in place)
    slot_heads: torch.Tensor,  # [nT] int64
    num_heads: int,
    page: torch.Tensor,  # [1] int64 logical page
    tail: torch.Tensor,  # [B, nT] int64 physical page of the newest page (updated in place)
    when: torch.Tensor | None = None,  # [1] bool: change nothing unless it holds (None: always)
) -> None:
    """Give logical ``page`` the first free slot of every (row, slot head): the slot row, the table entry and
    ``tail`` (its physical page).  A (row, head) without a free slot changes nothing (the layer sizes its slots so
    that one is always free: ``FlexiCacheConfig.resident_slots``)."""
    free = slot_page < 0
    first = free.int().argmax(-1, keepdim=True)  # [B, nT, 1]
    on = free.any(-1, keepdim=True)  # [B, nT, 1]
    if when is not None:
        on = on & when
    phys = slot_phys.gather(-1, first)
    pages = torch.zeros_like(first) + page  # [B, nT, 1]
    # Where off, the slot keeps its page, the table entry goes to its spare and the tail stays.
    slot_value = torch.where(on, pages, slot_page.gather(-1, first))
    table_pages = torch.where(on, pages, -1)
    new_tail = torch.where(on, phys, tail[..., None])[..., 0]
    slot_page.scatter_(-1, first, slot_value)
    set_table_entries(table_buffer, slot_heads, num_heads, table_pages, phys)
    tail.copy_(new_tail)


def reseat_slots(
    slot_page: torch.Tensor,  # [B, nT, S] int64 logical page each device slot holds (-1 = free), updated in place
    wanted: torch.Tensor,  # [B, nT, K] int64 pages to make resident (-1 = none, anywhere; no page twice)
    slot_phys: torch.Tensor,  # [B, nT, S] int64 physical page of each slot
    table_buffer: torch.Tensor,  # [B * H * cap + 1] int32 page table (flat) and a last spare entry, updated in place
    slot_heads: torch.Tensor,  # [nT] int64 the KV head of each slot row
    num_heads: int,  # H, the table's heads
    null_page: int,  # the physical page the table points evicted pages to
    when: torch.Tensor | None = None,  # [1] bool: change nothing unless it holds (None: always)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Make exactly ``wanted`` resident in each (row, slot head): evicted pages (resident, not wanted) free their
    slots, their table entries go to ``null_page``; the r-th promoted page (wanted, not resident; in ``wanted``'s
    order) takes the r-th free slot (in slot order) and its table entry that slot's physical page.  Returns
    ``(pages, phys)`` ``[B, nT, K]``: the promoted pages and their physical pages, -1 elsewhere (what the caller
    loads from the host tier).  Fixed shapes, no host synchronisation."""
    B, nT, S = slot_page.shape
    sp = slot_page
    keep = (sp[..., :, None] == wanted[..., None, :]).any(-1) & (sp >= 0)  # [B, nT, S]
    present = (wanted[..., :, None] == sp[..., None, :]).any(-1)  # [B, nT, K]
    promote = (wanted >= 0) & ~present
    if when is not None:
        keep = torch.where(when, keep, sp >= 0)
        promote = promote & when
    evicted = torch.where(keep, torch.full_like(sp, -1), sp)
    set_table_entries(table_buffer, slot_heads, num_heads, evicted, torch.full_like(evicted, null_page))
    sp = torch.where(keep, sp, torch.full_like(sp, -1))
    # The r-th promoted page of a row takes the r-th free slot of that row.
    free_order = torch.sort(keep.int(), dim=-1, stable=True).indices  # free slots first
    rank = (promote.long().cumsum(-1) - 1).clamp_min(0)  # [B, nT, K]
    slot = free_order.gather(-1, rank.clamp_max(S - 1))
    pages = torch.where(promote, wanted, torch.full_like(wanted, -1))
    # Non-promoted entries write -1 into an extra dummy column, so one scatter needs no masking.
    sp = torch.cat([sp, sp.new_full((B, nT, 1), -1)], dim=-1)
    sp.scatter_(-1, torch.where(promote, slot, torch.full_like(slot, S)), pages)
    slot_page.copy_(sp[..., :S])
    phys = torch.where(promote, slot_phys.gather(-1, slot), torch.full_like(slot, -1))
    set_table_entries(table_buffer, slot_heads, num_heads, pages, phys)
    return pages, phys
