"""One cache's decode schedule, planned once per step and read by every layer.

Every layer of a decode step appends its token at the same position, starts a new page or fills one at the same
moment, and re-ranks its stable heads on the same steps; so the schedule is worked out once, at layer 0, and every
layer reads it.  It lives in **device scalars**, advanced by two kernels of the kernel table (``plan_step`` in
:meth:`DecodeState.advance`, ``begin_layer`` for each layer's part), so that a captured CUDA graph of the whole
forward advances it on every replay; kernels read the counts through pointers.  As kernels rather than traced tensor
code they are also written once per step: traced, their arithmetic was inlined into every reader
(:mod:`~flexicache_hf.kernels.reference_schedule` says what that cost a compile).  The host keeps a mirror
(:class:`StepPlan`) of the same integers while it drives the steps itself (eager decode, prompt chunks), which lets
the eager path skip work the schedule rules out (no re-rank due: no reseat).  Decode steps replayed from a graph
leave the mirror behind; it is re-read from the device (one synchronisation) the next time the host needs it, never
inside a step.  Before a step it will not drive itself the host is told of it (:meth:`DecodeState.announce`) and
counts it as run, which bounds the length from above without reading the device (:meth:`DecodeState.surely_fits`):
the cache synchronises only when that bound says the next token might not fit its capacity.

Positions here are **storage positions**: a token at model position ``t`` is stored at ``origin + t``, where
``origin = -T mod page_size`` for the first prompt chunk's ``T`` tokens, so that chunk ends on a page boundary.
Left padding is a prefix of the chunk, so every row's pages are counted back from the same end: a row's pages
are the ones it has alone, whatever its neighbours' lengths (with pages counted from position 0 they moved with
the padding, and a row's answer with its batch).  The first ``origin`` positions hold nothing (they count as
padding).

The same object counts what the steps did (:class:`DeviceCounters`), on the device, read when asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.library import custom_op

from ..kernels import KernelOps, ops_for
from ..load_stream import join_load_stream


@dataclass(frozen=True)
class StepPlan:
    """What the host knows of the step being run; ``None`` where it does not know (a graph replay).

    Layers consult it only to skip launches whose effect the device state would mask anyway, so a plan of
    ``None`` (run everything, predicated) and an exact plan give the same result.
    """

    new_page: bool | None  # this step's token starts a page
    page_full: bool | None  # this step's token fills its page
    stable_due: tuple[bool, ...] | None  # per layer: its stable heads re-rank at this step, before attending
    num_pages: int | None  # pages that exist once the token is appended
    stable_late: tuple[bool, ...] | None = None  # per layer: ... after attending (overlap_loads; else None)

    def may(self, flag: bool | None) -> bool:
        return flag is None or flag

    def due(self, layer: int) -> bool | None:
        """Whether ``layer``'s stable heads re-rank at this step before attending (None: unknown)."""
        return None if self.stable_due is None else self.stable_due[layer]

    def late(self, layer: int) -> bool | None:
        """Whether ``layer``'s stable heads re-rank at this step after attending (None: unknown)."""
        return None if self.stable_late is None else self.stable_late[layer]


GRAPH_PLAN = StepPlan(None, None, None, None)  # a captured step: nothing is known on the host


class DecodeState:
    """Device scalars of the current decode step, shared by every layer of one cache.

    Persistent counters: ``origin`` (the storage position of model position 0, see the module docstring),
    ``length`` (the storage position after this step's token, capped at ``origin + capacity``),
    ``step`` (decode steps since the last prompt chunk), ``rerank_all`` (step 0 re-ranks every head: the last
    prompt chunk was a follow-up one, whose pages no selection has seen), ``overflow`` (a step went past
    ``capacity``: set in a graph, raised by the host; a backstop, since the cache refuses a step announced to it
    before it runs, see :meth:`surely_fits`).  Per step, from :meth:`advance`: ``current`` (this step's index),
    ``pos``, ``page``, ``offset``, ``num_pages``, ``new_page``, ``page_full``.  Every tensor has shape ``[1]`` and
    a fixed address for the cache's life.

    Per layer, from :meth:`begin_layer` (each layer calls it as its step begins): ``due`` (its stable heads re-rank
    now, on the steps ``s > 0`` with ``s ≡ phase (mod R)``, and on step 0 after a follow-up chunk) and ``anchor``
    (the newest page when they last re-ranked). With ``overlap`` (``FlexiCacheConfig.overlap_loads``) the steps
    ``s > 0`` on phase are ``late`` instead (the heads attend their previous selection, then re-rank:
    :mod:`~flexicache_hf.layer.decode`), and ``since`` keeps the anchor their attention extends from. After a first
    prompt chunk the prompt's last query was their first re-rank (each layer seats its top-K and sets its anchor
    then), so step 0 re-ranks none of them. Each layer's scalars, its phase included, are tensors of their own,
    which its kernels take.
    """

    def __init__(self, device: torch.device, page_size: int, rerank_interval: int, capacity: int | None,
                 phases: tuple[int, ...] = (0,), counts_steps: bool = True, overlap: bool = False,
                 ops: KernelOps | None = None):
        self.device, self.page_size, self.interval = torch.device(device), page_size, rerank_interval
        self.ops = ops_for(self.device) if ops is None else ops  # plan_step / begin_layer (kernels.schedule)
        self.phases_host = tuple(phases)  # per layer: its stable re-rank step mod R (all 0: the paper's schedule)
        self.counts_steps = counts_steps  # of a cache's per-device schedules, one counts its decode steps
        self.capacity = capacity  # tokens the buffers hold (None: they grow, so no graph is captured)
        long = lambda: torch.zeros(1, dtype=torch.long, device=self.device)  # noqa: E731
        flag = lambda: torch.zeros(1, dtype=torch.bool, device=self.device)  # noqa: E731
        self.length, self.step, self.current, self.origin = long(), long(), long(), long()
        self.pos, self.page, self.offset, self.num_pages = long(), long(), long(), long()
        self.new_page, self.page_full, self.overflow, self.rerank_all = flag(), flag(), flag(), flag()
        self.phases = [torch.full((1,), ph, dtype=torch.long, device=self.device) for ph in self.phases_host]
        self.due = [flag() for _ in self.phases_host]
        self.anchor = [long() for _ in self.phases_host]
        self.overlap = overlap
        # begin_layer's kernel takes both lists whether or not it writes them (only with overlap)
        self.late = [flag() for _ in self.phases_host]
        self.since = [long() for _ in self.phases_host]
        self.host_length = 0  # the host's mirror of `length` and `step` (valid unless `stale`)
        self.host_origin = 0  # the host's mirror of `origin` (set by the first chunk, never by a step)
        self.host_step = 0
        self.host_rerank_all = False
        self.stale = False  # graph replays advanced the device state past the mirror
        self.announced = 0  # tokens of forwards announced since the mirror was last exact (counted as run)
        self.last_announced = 0  # the newest announcement's tokens (it may run after the mirror is read)
        self.overflowed = False  # the host saw `overflow` set
        self.plan: StepPlan | None = None  # the host's plan of the step under way (eager steps)
        self.counters = DeviceCounters(self.device)

    def tensors(self) -> list[torch.Tensor]:
        """The state that changes (what reset() clears; the phases are configuration)."""
        return [self.length, self.step, self.current, self.origin, self.pos, self.page, self.offset, self.num_pages,
                self.new_page, self.page_full, self.overflow, self.rerank_all, self.counters.values, *self.due,
                *self.anchor, *self.late, *self.since]

    def buffers(self) -> list[torch.Tensor]:
        """Every device tensor a decode step reads (fixed addresses for graph capture)."""
        return self.tensors() + self.phases

    def device_length(self) -> torch.Tensor:
        """Tokens held (0-d), read on the device where this call stands: through an op, so that in a compiled
        forward inductor cannot move the read into a later kernel, after a step's first layer advanced ``length``
        (``graph_step.py``)."""
        return _held(self.length, self.origin)

    def due_of(self, layer: int) -> torch.Tensor:
        """``[1]`` bool: ``layer``'s stable heads re-rank at this step (valid after :meth:`begin_layer`)."""
        return self.due[layer]

    def anchor_of(self, layer: int) -> torch.Tensor:
        """``[1]``: the newest page when ``layer``'s stable heads last re-ranked (valid after :meth:`begin_layer`)."""
        return self.anchor[layer]

    def late_of(self, layer: int) -> torch.Tensor | None:
        """``[1]`` bool: ``layer``'s stable heads re-rank after attending at this step (``None`` without overlap)."""
        return self.late[layer] if self.overlap else None

    def since_of(self, layer: int) -> torch.Tensor:
        """``[1]``: the anchor ``layer``'s stable heads attend from at this step (the one before a late re-rank)."""
        return self.since[layer] if self.overlap else self.anchor[layer]

    # ---- the step ---------------------------------------------------------------------------------------
    def advance(self) -> None:
        """Plan the next decode token (one kernel, ``plan_step``: runs inside a captured graph)."""
        capacity = -1 if self.capacity is None else self.capacity  # positions the buffers hold past the origin
        self.ops.plan_step(self.length, self.step, self.current, self.pos, self.page, self.offset, self.num_pages,
                           self.new_page, self.page_full, self.overflow, self.origin, self.page_size, capacity)
        if self.counts_steps:
            self.counters.add("decode_steps", 1)

    def begin_layer(self, layer: int) -> None:
        """``layer``'s part of the step :meth:`advance` planned: whether its stable heads re-rank now, and their
        anchor (one kernel, ``begin_layer``, on that layer's own scalars; runs inside a captured graph)."""
        self.ops.begin_layer(self.due[layer], self.anchor[layer], self.late[layer], self.since[layer], self.current,
                             self.phases[layer], self.rerank_all, self.page, self.interval, self.overlap)

    def begin_eager_step(self) -> StepPlan:
        """:meth:`advance`, plus the host's exact plan of the same step."""
        self.sync()
        pos, ps = self.host_length, self.page_size
        step, r = self.host_step, self.interval
        due = tuple(self.host_rerank_all if step == 0 else (step - ph) % r == 0 for ph in self.phases_host)
        late = None
        if self.overlap:  # step 0's re-rank (after a follow-up chunk) comes first; the others after attending
            late = tuple(d and step > 0 for d in due)
            due = tuple(d and step == 0 for d in due)
        self.plan = StepPlan(new_page=pos % ps == 0, page_full=pos % ps == ps - 1, stable_due=due,
                             num_pages=pos // ps + 1, stable_late=late)
        self.advance()
        self.host_length, self.host_step = pos + 1, self.host_step + 1
        return self.plan

    def add_chunk(self, tokens: int) -> None:
        """A prompt chunk of ``tokens`` went in: the next decode step is step 0 again.  After a first chunk the
        layers seat their stable heads' top-K from the prompt's last query, which stands for step 0's re-rank;
        after a follow-up chunk (pages no selection has scored) step 0 re-ranks every head."""
        self.sync()
        follow_up = self.host_length > 0
        if not follow_up:  # the first chunk ends on a page boundary: its rows' pages are counted back from there
            self.host_origin = -tokens % self.page_size
            self.origin.fill_(self.host_origin)
            self.host_length = self.host_origin
        self.host_length += tokens
        self.host_step = 0
        self.host_rerank_all = follow_up
        self.length.fill_(self.host_length)
        self.step.zero_()
        self.rerank_all.fill_(follow_up)
        self.plan = None

    def follow(self, other: "DecodeState") -> None:
        """Take ``other``'s schedule (a state made part-way through the first prompt forward, for a later device
        of a model split across devices: layer 0 already counted the chunk in ``other``)."""
        other.sync()
        self.host_origin = other.host_origin
        self.origin.fill_(other.host_origin)
        self.restore(other.host_length, other.host_step, other.host_rerank_all)

    # ---- going back -------------------------------------------------------------------------------------
    def due_at(self, layer: int, step: int) -> bool:
        """Host-side: whether ``layer``'s stable heads re-rank at decode step ``step`` (of the current chunk)."""
        return (step > 0 and (step - self.phases_host[layer]) % self.interval == 0) or (step == 0 and
                                                                                     self.host_rerank_all)

    def anchor_page(self, layer: int, step: int) -> int:
        """Host-side: the newest page when ``layer``'s stable heads last re-ranked, once decode step ``step`` of the
        current chunk ran (``-1``: none ran): the page of its last due step, else the prompt chunk's last page (the
        prompt's seat).  The anchor is a function of the schedule, so it can be set again after going back."""
        end = self.host_length - self.host_step  # tokens when the last chunk ended; step i stores position end + i
        last = step - (step - self.phases_host[layer]) % self.interval if step > 0 else 0
        if last <= 0:
            last = 0 if step >= 0 and self.host_rerank_all else -1
        return (end + last) // self.page_size

    def mirror(self) -> tuple[int, int, bool]:
        """The host's ``(length, step, rerank_all)``: what :meth:`restore` takes to set the schedule back."""
        return self.host_length, self.host_step, self.host_rerank_all

    def restore(self, length: int, step: int, rerank_all: bool) -> None:
        """Set the schedule to ``length`` tokens, ``step`` decode steps since the last chunk and the chunk's
        ``rerank_all``, with every layer's anchor as those steps left it (in place: a captured step reads them)."""
        self.host_length, self.host_step, self.host_rerank_all = length, step, rerank_all
        self.length.fill_(length)
        self.step.fill_(step)
        self.rerank_all.fill_(rerank_all)
        for layer, anchor in enumerate(self.anchor):
            anchor.fill_(self.anchor_page(layer, step - 1))
        self.plan = None

    def crop(self, tokens: int) -> None:
        """Forget the newest ``tokens`` tokens.  The decode steps that stored them are undone exactly when none of
        them re-ranked a layer's stable heads (their selections are then those the kept steps made); otherwise, or
        when the tokens reach into the last prompt chunk, the next step re-ranks every head, as after a follow-up
        chunk."""
        self.sync()
        s, layers = self.host_step, range(len(self.phases_host))
        exact = tokens <= min(s, self.interval) and not any(self.due_at(l, i) for l in layers
                                                            for i in range(s - tokens, s))
        self.restore(self.host_length - tokens, s - tokens if exact else 0, self.host_rerank_all if exact else True)

    # ---- room for the next forward, on the host ---------------------------------------------------------
    def announce(self, tokens: int) -> None:
        """A forward of ``tokens`` tokens is about to run, perhaps replayed from a graph (which the host does not
        follow): counted as run until the mirror is next read (see :meth:`surely_fits`)."""
        self.announced = (self.announced if self.stale else 0) + tokens
        self.last_announced = tokens

    def surely_fits(self, tokens: int) -> bool:
        """Whether ``tokens`` more tokens surely fit the capacity, known on the host (never synchronises).  While
        graph replays keep the mirror stale, every forward announced since it was exact counts as run: an upper
        bound of the length, so ``True`` is certain and ``False`` only means "synchronise and look again" (an
        over-count, e.g. a step announced twice, costs a synchronisation, never a refusal).  With the mirror
        exact, the answer is exact."""
        if self.capacity is None:
            return True
        ahead = self.announced if self.stale else 0
        return self.host_length + ahead + tokens <= self.host_origin + self.capacity

    def sync(self) -> None:
        """Bring the host mirror up to date after graph replays (one device synchronisation); the compute stream
        waits for any page load still behind it (a forward that stopped before its last layer's join)."""
        self.join_loads()
        if self.stale:  # (eager steps never pass the capacity: the host refuses them first)
            self.host_length, self.host_step = int(self.length), int(self.step)
            self.stale = False
            self.announced = self.last_announced  # the newest announced forward may not have run yet
            self.overflowed = self.overflowed or bool(self.overflow)
        self.check()

    def check(self) -> None:
        """Refuse to go on from a state a graph replay pushed past the capacity (until :meth:`reset`)."""
        if self.overflowed:
            raise OverflowError(
                f"decoding went past max_cache_len={self.capacity} tokens inside a captured decode step: the "
                "tokens generated after that point are not valid. Make the cache with a max_cache_len of at least "
                "the prompt length + max_new_tokens, then reset() it or use a new one"
            )

    def join_loads(self) -> None:
        """Eagerly: the compute stream waits for every page load behind it on this device (``overlap``)."""
        if self.overlap:
            join_load_stream(self.device)

    def reset(self) -> None:
        self.join_loads()
        for t in self.tensors():
            t.zero_()
        self.host_length = self.host_step = self.host_origin = 0
        self.host_rerank_all = False
        self.stale, self.overflowed, self.plan = False, False, None
        self.announced = self.last_announced = 0


class DeviceCounters:
    """Counts kept on the device (adding to them never synchronises); reading one does."""

    NAMES = ("decode_steps", "promoted_pages", "offloaded_pages", "pages_attended")

    def __init__(self, device: torch.device):
        self.values = torch.zeros(len(self.NAMES), dtype=torch.long, device=device)

    def add(self, name: str, amount) -> None:
        i = self.NAMES.index(name)
        self.values[i : i + 1].add_(amount)

    def read(self) -> dict[str, int]:
        return dict(zip(self.NAMES, self.values.tolist()))


def state_for_device(states: dict[str, DecodeState], device: torch.device, config, num_layers: int,
                     capacity: int | None, kernels: str | None = None) -> DecodeState:
    """The schedule in ``states`` (one per device a cache's layers live on; they hold the same values) for
    ``device``, made on first use: the first one counts the decode steps, a later one (a model split by
    ``device_map``, made during the first prompt forward) catches up with the first."""
    key = str(device)
    if key not in states:
        first = not states
        phases = tuple(config.rerank_phase(i) for i in range(num_layers))
        state = DecodeState(device, config.page_size, config.rerank_interval, capacity, phases, counts_steps=first,
                            overlap=config.overlap_loads, ops=ops_for(device, prefer=kernels))
        if not first:
            state.follow(next(iter(states.values())))
        states[key] = state
    return states[key]


@custom_op("flexicache::held", mutates_args=())
def _held(length: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    return length[0] - origin[0]


@_held.register_fake
def _(length, origin):
    return length.new_empty(())
