"""``FlexiCache(Cache)``: plans each step once and does the cross-layer work; its layers store and execute.

transformers calls ``k, v = cache.update(k, v, layer_idx)`` and hands ``k, v`` to the attention function.
``update`` stores the new states in the layer and returns a :class:`~flexicache_hf.handle.PagedKV` handle; the
registered ``"flexicache"`` attention function (:mod:`flexicache_hf.attention`) gives it back to :meth:`attend`:
exact attention for prompt chunks, top-K selection + sparse paged decode for single-token steps.  The handle is
the only channel between the two: no globals, no thread-locals, no patched model code.

The cache owns what spans layers: the step schedule (one :class:`~flexicache_hf.layer.schedule.DecodeState` per
device, advanced at layer 0), the order of a forward (:class:`~flexicache_hf.handle.ForwardGuard`), lengths (a
sized cache refuses a forward that would not fit before it runs, compiled or not:
:meth:`FlexiCache.get_mask_sizes`), the host-memory cap over every layer, a follow-up chunk's prefix read started
one layer ahead, the copies joined after the last layer, recycling, statistics.  A layer never refers to its cache.
"""

from __future__ import annotations

import copy
import os
import weakref
import torch
from transformers.cache_utils import Cache

from .block_keeper import BLOCKS
from .config import FlexiCacheConfig
from .crop import crop, undo_refused
from .graph_step import GraphStep, register
from .handle import CacheStateError, ForwardGuard, PagedKV
from .head_profile import HeadProfile, resolve_profile
from .kernels import build_ahead
from .layer import FlexiCacheLayer, LayerSpec
from .lengths import check_room, refuse_length
from .layer.schedule import DecodeState, state_for_device
from .model_check import check_served
from .stats import CacheAccounting, CacheStats
from .host_room import check_host_growth
from .recycling import KEEPER, storage_key, take_kept_storage
from .rows import checked_rows
from .reserve import before_step, compileable_unsized, fit_reserved, plan_forward, reserve_first
from .settings import resolve_settings
from .rerank import SelectionObserver


def plan_host(layers: list, end: int, key_states: torch.Tensor, tp_size: int | None, limit: int | None) -> None:
    """At the first layer's update: refuse (HostMemoryError) a forward whose host tiers, every layer's once grown for
    ``end`` tokens (a layer before its first forward: predicted from these states), would pass ``limit``
    (``host_memory_limit``), or whose new blocks would not fit in the machine's memory (:mod:`~flexicache_hf.host_room`);
    on CUDA, start page-locking the blocks the layers will take, in layer order, while the layers before them compute
    (:meth:`~flexicache_hf.block_keeper.BlockKeeper.prefetch`)."""
    plans = [layer.host_plan(end, key_states, tp_size) for layer in layers]
    check_host_growth(sum(sum(n for n, _ in plan) if plan else layer.host_bytes() for layer, plan in zip(layers, plans)),
                      limit, new=sum(n for plan in plans for n, _ in plan))
    if key_states.device.type == "cuda" and any(plans):
        BLOCKS.prefetch([block for plan in plans for block in plan], key_states.device)


class FlexiCache(CacheAccounting, Cache):
    """Stability-aware hierarchical KV cache (FlexiCache) for transformers' ``generate``.

    Example::

        import flexicache_hf
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flexicache")
        out = model.generate(**inputs, past_key_values=flexicache_hf.FlexiCache("Llama-3.1-8B-Instruct"))

    Args:
        profile: a :class:`HeadProfile`, a path to a profile JSON, or a model name shipped in ``profiles/``.
        config: a :class:`FlexiCacheConfig`, used wholesale (``FlexiCacheConfig.paper()``: the paper's); without it the
            profile's settings (:mod:`~flexicache_hf.settings`), keyword fields on top (``token_budget=1024``).
        model_config: the model's ``PretrainedConfig``; checks the profile and attention layout now instead
            of at the first forward.
        observer: a :class:`SelectionObserver` told of every re-rank (the stability profiler uses it).
        kernels: ``"reference"`` forces the PyTorch reference kernels on any device.
        count_pages: count attended pages per step in ``stats`` (a device counter: two small kernels per layer and step).
        max_cache_len: the most tokens this cache will hold (prompt + ``max_new_tokens``, as for ``StaticCache``):
            everything is allocated once, at the first forward, and on CUDA ``generate`` compiles and CUDA-graphs the
            decode step as for StaticCache (``disable_compile=True`` keeps it eager).  A forward that would go past it
            is refused before it runs, compiled or not, with a ``ValueError`` (the cache keeps its tokens and serves
            on): a ``generate`` asked for more new tokens stops there, at the step that would not fit.  A compiled
            forward called directly, not by ``generate``, is not checked first: a step past the end stays inside the
            buffers, and the cache's next use raises ``OverflowError`` until :meth:`reset`.  Without it storage
            grows with headroom.  A dropped cache's storage serves the next cache of its shape (``storage_reused``).
    """

    def __init__(self, profile: HeadProfile | str | os.PathLike, config: FlexiCacheConfig | None = None, *,
                 model_config=None, observer: SelectionObserver | None = None, kernels: str | None = None,
                 count_pages: bool = False, max_cache_len: int | None = None, profiles_dir=None, **config_fields):
        self.profile, self.config, self.settings_source = resolve_settings(
            resolve_profile(profile, profiles_dir=profiles_dir), config, config_fields)
        if kernels not in (None, "reference"):
            raise ValueError(f"kernels must be None or 'reference', got {kernels!r}")
        self.kernels, self._observer, self.count_pages = kernels, observer, count_pages
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be None or a positive number of tokens, got {max_cache_len!r}")
        self.max_tokens = max_cache_len  # not `max_cache_len`: transformers 5.17 has a property of that name
        self.prompt_tokens = 0
        self.storage_reused, self.first_reserve = False, None  # recycling.py's flag; reserve.plan_forward's plan
        # The step schedule, one DecodeState per device a layer lives on (a model split by device_map has several;
        # they hold the same values), made when the first layer on each device allocates.
        self.states: dict[str, DecodeState] = {}
        # the model's context and tensor-parallel size, once check_model saw its config (see sharding.py)
        self.max_positions = self.tp_size = self._checked_config = None
        self.context_reserved = False  # max_positions is the reserved storage's context, below the model's
        compileable = self.is_compileable
        layers = [FlexiCacheLayer(LayerSpec(i, self.profile.unstable_heads(i), self.config, self.profile.model,
                                            self.max_tokens, compileable, kernels, count_pages, observer))
                  for i in range(self.profile.model.num_layers)]
        super().__init__(layers=layers)
        self.guard = ForwardGuard(len(layers))
        self.before: dict[str, tuple] = {}  # each schedule's host mirror before the forward (undo_refused)
        key = storage_key(self)
        if key is not None:  # dropped, its storage serves the next cache of its shape (recycling.py: graphs replay)
            weakref.finalize(self, KEEPER.keep, key, self.layers, self.states).atexit = False
        if model_config is not None:
            self.check_model(model_config)
        if kernels is None and torch.cuda.is_available():  # the CUDA backend, on a thread, while the prefill nears
            build_ahead()

    @property
    def observer(self) -> SelectionObserver | None:  # fixed when the cache is made (its layers were told it)
        return self._observer

    @observer.setter
    def observer(self, value) -> None:
        raise AttributeError("a FlexiCache's observer is fixed when it is made: FlexiCache(profile, observer=...)")

    # ---- one forward: update(0), attend(0), ..., attend(L-1) ----------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store layer ``layer_idx``'s new states ``[B, H, T, D]``; returns ``(handle, handle)`` for the attention."""
        if torch.compiler.is_compiling():  # a decode step being captured: device state only
            return self._graph_update(key_states, value_states, layer_idx)
        try:
            return self._update(key_states, value_states, layer_idx)
        except BaseException as e:
            self.guard.note(e)
            raise

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        if layer_idx == 0:
            if not self.states and not self.guard.open:  # a new (or dropped-to-empty) cache
                take_kept_storage(self, key_states)
            self.ensure_usable()  # a forward left part-way: start over (if it began empty) or refuse
        layer = self.layers[layer_idx]
        if layer.is_initialized and layer.seq_len == 0 and not layer.storage.fits(key_states):
            layer.drop()  # buffers kept by reset() for another batch or dtype: allocate anew
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states, self.decode_state(key_states.device), self.tp_size)
        layer.storage.check_states(key_states)  # FlexiCache's own message, before anything is written
        if layer_idx == 0:
            self.sync()  # after graph replays: the host learns the length (and refuses an overflow)
        start, T = layer.seq_len, key_states.shape[2]
        self.check_length(start + T)
        if layer_idx == 0:  # every layer's host tier, before any layer grows or commits (reserve.py)
            self.first_reserve = plan_forward(self, start + T, key_states, plan_host)
        reserve_first(self, layer)  # a first forward's layer laid out reserved before it stores: no move
        # (room only: the tokens stay as they are; the other layers' host bytes are summed only when it grows)
        layer.grow(start + T, self.host_bytes() - layer.host_bytes() if layer.grows(start + T) else 0)
        self.guard.begin(layer_idx, "update", empty=start == 0)  # validated: from here on storage changes
        if layer_idx == 0:  # plan the step once, for every layer
            register(self)  # the compiled steps' op finds this cache by its schedule (graph_step.py)
            self.before = {key: state.mirror() for key, state in self.states.items()}  # (undo_refused)
            for state in self.states.values():
                state.begin_eager_step() if T == 1 and start > 0 else state.add_chunk(T)
        offloaded = layer.store(key_states, value_states)
        self.guard.end(layer_idx, "update")
        handle = PagedKV(self, layer_idx, key_states, value_states, start, offloaded)
        return handle, handle

    def _graph_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """A decode step's update as ``torch.compile`` traces it: the host mirror marked behind (layer 0), and a
        :class:`~flexicache_hf.graph_step.GraphStep` returned, whose op (run by the attention function) plans the step
        and stores the token.  Prompts and later chunks run eagerly (:meth:`update`) and allocate everything."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized or key_states.shape[2] != 1:
            raise CacheStateError(
                "a compiled FlexiCache forward serves one-token decode steps of a cache filled eagerly (generate does "
                "so); a long prompt in chunks: flexicache_hf.prefill_in_chunks, not prefill_chunk_size, which compiles "
                "them; multi-token drafts (assisted decoding): generate(..., disable_compile=True)"
            )
        if layer_idx == 0:
            for state in self.states.values():
                state.stale = True  # the host mirror is behind from here on (applied after each compiled call)
        handle = GraphStep(layer_idx, key_states, value_states, layer.state.length, layer.storage.pool.k)
        return handle, handle

    def attend(self, handle: PagedKV, query: torch.Tensor, mask2d: torch.Tensor | None, scaling: float,
               model_config=None) -> torch.Tensor:
        """Attention output ``[B, T, Hq, D]`` for ``query [B, Hq, T, D]`` of the layer ``handle`` came from (called
        by the attention function with the module's config, checked here at the first forward)."""
        idx = handle.layer_idx
        layer = self.layers[idx]
        decode = query.shape[2] == 1 and handle.start > 0
        try:  # checks: a refusal here changed nothing of the attention
            if model_config is not None:
                self.check_model(model_config)
                self.check_length(layer.seq_len)  # the first forward learns the context only here
            if handle.cache is not self or handle.start + handle.keys.shape[2] != layer.seq_len:
                raise CacheStateError(f"a stale FlexiCache handle reached layer {idx}'s attention")
            self.guard.begin(idx, "attend")
            lead = layer.check_padding(handle, mask2d, decode, first=idx == 0)  # (every layer's mask is layer 0's)
        except Exception as e:
            self.refused(handle, e)
            raise
        if decode:
            out = layer.attend_token(query, scaling)
        else:
            layer.observe_chunk(handle, lead)
            if handle.start and idx + 1 < len(self.layers):  # the next layer's host read overlaps this attention
                self.layers[idx + 1].prefetch_prefix(handle.start)
            self.prompt_tokens += query.shape[2] if idx == 0 else 0
            out = layer.attend_chunk(handle, query, scaling)
            if idx == len(self.layers) - 1 and self.is_compileable:
                # The next step may be a graph replay, which cannot wait on the copy streams itself: the compute
                # stream waits here for the chunk's offload (on the device; the host goes on).
                for each in self.layers:
                    if each.is_initialized:
                        each.storage.join_copies()
        self.guard.end(idx, "attend")
        return out

    def refused(self, handle: PagedKV, error: BaseException) -> None:
        """A refusal at ``handle``'s attention, before it changed anything: undone at the forward's first layer (the
        cache serves on as before the call, :func:`~flexicache_hf.crop.undo_refused`), else noted for the next use."""
        if not undo_refused(self, handle):
            self.guard.note(error)

    def ensure_usable(self) -> None:
        """Act on a forward that stopped part-way (some layers hold its tokens, others not): one that began on an
        empty cache lost nothing, so the cache is emptied; otherwise :class:`CacheStateError` until :meth:`reset`.
        Another thread's forward under way is refused (``ConcurrentUseError``)."""
        self.guard.check_thread()
        if self.guard.open:
            if not self.guard.began_empty:
                raise self.guard.stopped_error()
            self.reset()

    def check_length(self, end: int) -> None:
        """Refuse ``end`` positions beyond the model's context or ``max_cache_len`` (:mod:`~flexicache_hf.lengths`)."""
        refuse_length(end, self.max_positions, self.max_tokens, self.context_reserved)

    def check_model(self, model_config) -> None:
        """Refuse a model this cache cannot serve: another shape than the profile's, or non-full attention."""
        if model_config is not self._checked_config:
            context, self.tp_size = check_served(self.profile, model_config, self.max_tokens)
            self._checked_config = model_config
            self.max_positions = fit_reserved(self, context)
            self.context_reserved = self.max_positions != context

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate`` may compile (and CUDA-graph) the decode step, as for StaticCache: with a ``max_cache_len``
        (fixed addresses), the GPU kernels and no observer (told of every re-rank on the host)."""
        return (self.max_tokens is not None or compileable_unsized()) and self.kernels is None and self.observer is None

    def decode_state(self, device: torch.device) -> DecodeState:
        """The step schedule all layers on ``device`` share (made for the first layer to allocate there)."""
        return state_for_device(self.states, device, self.config, len(self.layers), self.max_tokens, self.kernels)

    def sync(self) -> None:
        """Bring every layer's host-side length up to date after captured decode steps (one synchronisation;
        raises if a captured step went past ``max_cache_len``)."""
        for state in self.states.values():
            state.sync()
        for layer in self.layers:
            if layer.is_initialized:
                layer.catch_up()

    # ---- HF cache API ---------------------------------------------------------------------------------------
    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """The layer's ``(kv_length, kv_offset)``; asked eagerly before every step ``generate`` runs, even a compiled
        one, so a sized cache refuses here the tokens that would not fit (:func:`~flexicache_hf.lengths.check_room`)."""
        if not torch.compiler.is_compiling():
            before_step(self, query_length.shape[0] if isinstance(query_length, torch.Tensor) else query_length,
                        check_room)
        return super().get_mask_sizes(query_length, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if torch.compiler.is_compiling() and self.layers[layer_idx].is_initialized:
            return self.layers[layer_idx].device_length()  # the device count (the host's would guard on it)
        self.ensure_usable()
        return super().get_seq_length(layer_idx)

    def _rows(self, method: str, arg) -> None:
        """Beam reorder / batch selection / expansion (each row's newest page is found from the synchronised length)."""
        self.ensure_usable()
        arg = checked_rows(method, arg, self.layers)  # before any layer takes it
        self.sync()
        getattr(super(), method)(arg)

    def crop(self, max_length: int) -> None:
        """Drop the newest tokens (assisted decoding's rejected draft): ``crop(-n)`` drops ``n``, ``crop(n)`` keeps
        the first ``n`` (transformers < 5.18's form), ``crop(0)`` changes nothing; see :mod:`flexicache_hf.crop`."""
        crop(self, max_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows("reorder_cache", beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows("batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows("batch_select_indices", indices)

    def reset(self) -> None:
        """Empty every layer (the cache is then as new: statistics too; the profile and config stay)."""
        self.guard.check_thread()
        super().reset()
        self.guard.clear()
        self.prompt_tokens = 0
        self.storage_reused = False
        if any(layer.is_initialized for layer in self.layers):  # buffers kept (max_cache_len): so is the schedule,
            for state in self.states.values():  # zeroed at its addresses (a captured step reads them)
                state.reset()
        else:
            self.states.clear()

    # ---- copies and pickles ---------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """What ``pickle`` / ``torch.save`` store: every layer's pages, tiers and selection state (pending copies
        finish first; streams and kernels are re-made and the host tier re-pinned where it is loaded; the model
        config is checked again at the next forward)."""
        self.ensure_usable()
        for layer in self.layers:
            if layer.is_initialized:
                layer.storage.copies.synchronize()
                if layer.storage.device.type == "cuda":
                    torch.cuda.current_stream(layer.storage.device).synchronize()
        state = dict(self.__dict__)
        state["_checked_config"] = None
        return state

    def __deepcopy__(self, memo: dict) -> "FlexiCache":
        """An independent cache holding the same tokens (transformers' prefix-reuse pattern); the profile
        (immutable) and the observer (a callback, e.g. the profiler) are shared with the original."""
        state = self.__getstate__()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for shared in (self.profile, self.observer):
            memo[id(shared)] = shared
        new.__dict__.update(copy.deepcopy(state, memo))
        return new

    def __repr__(self) -> str:
        c = self.config
        return (f"FlexiCache({self.profile.model.name or self.profile.model.model_type}, page_size={c.page_size}, "
                f"token_budget={c.token_budget}, rerank_interval={c.rerank_interval}, offload={c.offload}, "
                f"unstable={len(self.profile.unstable)}/{self.profile.model.num_layers * self.profile.model.num_kv_heads}, "
                f"settings: {self.settings_source})")
