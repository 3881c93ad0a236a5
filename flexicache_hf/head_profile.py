"""Per-model head-stability profiles: which KV heads FlexiCache treats as unstable.

FlexiCache keeps every page of an *unstable* KV head on the GPU and offloads the
cold pages of *stable* heads.  Which heads are unstable is a property of the model
(the paper measures it once, offline), so a profile is tied to a model shape and is
checked against the model before use.  Heads are KV heads: under GQA a whole group
of query heads shares one KV head, and the cache can only be split per KV head.
"""

from __future__ import annotations

import json
import math
import os
import random as _random
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from .config import ConfigError
from .model_identity import ModelIdentity, ProfileError, _identity, _is_int, _is_number  # noqa: F401 (re-exported)
from .settings import ProfileSettings

FORMAT = "flexicache-head-profile"
FORMAT_VERSION = 1

Head = tuple[int, int]


def _head(x: Any, what: str) -> Head:
    if not isinstance(x, (tuple, list)) or len(x) != 2 or not all(_is_int(v) for v in x):
        raise ProfileError(f"{what} must be a (layer, kv_head) pair of integers, found {x!r}")
    return (x[0], x[1])


@dataclass(frozen=True)
class HeadProfile:
    """Which (layer, kv_head) pairs are unstable for one model shape.

    ``scores`` (temporal-stability TS per head, higher = more stable) and
    ``provenance`` are stored as read-only ``MappingProxyType`` views over private
    copies, and are left out of ``hash()`` (they still take part in ``==``), so a
    profile can key a dict while its metadata cannot be changed behind its back.
    ``settings`` (:class:`~flexicache_hf.settings.ProfileSettings`, optional): the FlexiCacheConfig fields and
    unstable fraction measured best for the model, and the measurement that chose them; ``FlexiCache(profile)``
    without a config uses them (:func:`~flexicache_hf.settings.resolve_settings`).
    """

    model: ModelIdentity
    unstable: frozenset[Head]
    scores: Mapping[Head, float] | None = field(default=None, hash=False)
    provenance: Mapping[str, Any] = field(default_factory=dict, hash=False)
    format_version: int = FORMAT_VERSION
    settings: ProfileSettings | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelIdentity):
            raise ProfileError(f"model must be a ModelIdentity, found {type(self.model).__name__}")
        if not _is_int(self.format_version) or not 1 <= self.format_version <= FORMAT_VERSION:
            raise ProfileError(f"format_version must be 1..{FORMAT_VERSION}, found {self.format_version!r}")
        if isinstance(self.unstable, (str, bytes)) or not isinstance(self.unstable, Iterable):
            raise ProfileError(f"unstable must be a set of (layer, kv_head) pairs, found {self.unstable!r}")
        heads = frozenset(self._checked(_head(h, "unstable head")) for h in self.unstable)
        object.__setattr__(self, "unstable", heads)
        if self.scores is not None:
            if not isinstance(self.scores, Mapping):
                raise ProfileError(f"scores must map (layer, kv_head) -> float, found {type(self.scores).__name__}")
            scores = {}
            for k, v in self.scores.items():
                k = self._checked(_head(k, "scores key"))
                if not _is_number(v) or not math.isfinite(v):
                    raise ProfileError(f"score of head {k} must be a finite number, found {v!r}")
                scores[k] = float(v)
            object.__setattr__(self, "scores", MappingProxyType(scores))
        if not isinstance(self.provenance, Mapping):
            raise ProfileError(f"provenance must be a JSON object, found {type(self.provenance).__name__}")
        try:  # a private deep copy, and proof that it will serialise
            prov = json.loads(json.dumps(dict(self.provenance), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ProfileError(f"provenance must be JSON-serialisable: {e}") from e
        object.__setattr__(self, "provenance", MappingProxyType(prov))
        if self.settings is not None:
            try:
                settings = self.settings
                if not isinstance(settings, ProfileSettings):
                    settings = ProfileSettings.from_dict(settings)
            except ConfigError as e:
                raise ProfileError(f"'settings': {e}") from None
            if settings.unstable_fraction is not None and not self.scores:
                raise ProfileError(f"settings' unstable_fraction ({settings.unstable_fraction}) needs per-head "
                                   "scores to re-cut the profile, and this profile has none")
            if settings.unstable_fraction is not None:  # re-cut when a cache is made: refused now, naming the file
                _check_every_head_scored(self.model, self.scores)
            object.__setattr__(self, "settings", settings)

    def __reduce__(self):
        # The read-only mapping views cannot be pickled or deep-copied; rebuild them from plain dicts.
        scores = None if self.scores is None else dict(self.scores)
        return (type(self), (self.model, self.unstable, scores, dict(self.provenance), self.format_version,
                             self.settings))

    def _checked(self, h: Head) -> Head:
        m = self.model
        if not (0 <= h[0] < m.num_layers and 0 <= h[1] < m.num_kv_heads):
            raise ProfileError(
                f"head {h} is out of range for {m.describe()}: expected layer in [0, {m.num_layers}) "
                f"and kv_head in [0, {m.num_kv_heads}); was this profile made for another model?"
            )
        return h

    # ---- queries -------------------------------------------------------------
    def _layer(self, layer: int) -> int:
        if not _is_int(layer) or not 0 <= layer < self.model.num_layers:
            raise ProfileError(f"layer must be in [0, {self.model.num_layers}), found {layer!r}")
        return layer

    def unstable_heads(self, layer: int) -> tuple[int, ...]:
        self._layer(layer)
        return tuple(sorted(h for l, h in self.unstable if l == layer))

    def stable_heads(self, layer: int) -> tuple[int, ...]:
        bad = set(self.unstable_heads(layer))
        return tuple(h for h in range(self.model.num_kv_heads) if h not in bad)

    def is_unstable(self, layer: int, head: int) -> bool:
        return self._checked(_head((self._layer(layer), head), "head")) in self.unstable

    @property
    def unstable_fraction(self) -> float:
        return len(self.unstable) / (self.model.num_layers * self.model.num_kv_heads)

    def least_stable(self, fraction: float) -> HeadProfile:
        """This profile re-cut from its measured scores: the ``fraction`` of heads with the lowest TS unstable
        (e.g. 0.375 instead of the profiler's 0.25; see the README's settings per model).  Raises ProfileError
        when the profile carries no scores (a published list of heads cannot be re-cut).  The profile's
        :attr:`settings` come along without their own ``unstable_fraction`` (this cut replaces it)."""
        if not self.scores:
            raise ProfileError("this profile has no per-head scores to re-cut (it lists its unstable heads only); "
                               "measure one with `python -m flexicache_hf.profile` to choose another fraction")
        prov = {**self.provenance, "fraction": fraction, "recut_from_fraction": self.unstable_fraction}
        cut = HeadProfile.from_scores(self.model, self.scores, fraction, provenance=prov)
        if self.settings is None:
            return cut
        return HeadProfile(cut.model, cut.unstable, cut.scores, cut.provenance, cut.format_version,
                           self.settings.without_fraction())

    def check_model(self, config: Any) -> None:
        """Raise ProfileError unless ``config`` (or a model / ModelIdentity) has this shape."""
        other = _identity(config)
        if not self.model.same_shape(other):
            raise ProfileError(
                f"head profile for {self.model.describe()} does not fit the model {other.describe()}; "
                "use a profile measured on this model, or build one with HeadProfile.random / "
                "HeadProfile.all_unstable"
            )

    # ---- serialisation -------------------------------------------------------
    def to_dict(self) -> dict:
        scores = None
        if self.scores is not None:
            scores = [[l, h, s] for (l, h), s in sorted(self.scores.items())]
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "model": self.model.to_dict(),
            "unstable_heads": [list(h) for h in sorted(self.unstable)],
            "scores": scores,
            "provenance": json.loads(json.dumps(dict(self.provenance))),
            **({} if self.settings is None else {"settings": self.settings.to_dict()}),
        }

    @classmethod
    def from_dict(cls, d: Any) -> HeadProfile:
        if not isinstance(d, dict):
            raise ProfileError(f"a head profile must be a JSON object, found {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise ProfileError(f"expected 'format': {FORMAT!r}, found {d.get('format')!r}; this is not a head profile")
        v = d.get("format_version")
        if not _is_int(v) or v < 1:
            raise ProfileError(f"expected an integer 'format_version' >= 1, found {v!r}")
        if v > FORMAT_VERSION:
            raise ProfileError(
                f"profile has format_version {v}, this flexicache_hf reads up to {FORMAT_VERSION}; upgrade flexicache_hf"
            )
        keys = ("format", "format_version", "model", "unstable_heads", "scores", "provenance")
        missing = [k for k in keys if k not in d]
        extra = sorted(set(d) - set(keys) - {"settings"})  # settings: optional (FlexiCacheConfig's defaults)
        if missing or extra:
            raise ProfileError(f"expected the keys {list(keys)} and optionally 'settings'; missing {missing}, "
                               f"unexpected {extra}")
        heads_in = d["unstable_heads"]
        if not isinstance(heads_in, list):
            raise ProfileError(f"'unstable_heads' must be a list of [layer, kv_head], found {type(heads_in).__name__}")
        heads = [_head(h, "unstable_heads entry") for h in heads_in]
        if len(set(heads)) != len(heads):
            raise ProfileError("'unstable_heads' lists a head twice; each head must appear once")
        scores = None
        if d["scores"] is not None:
            if not isinstance(d["scores"], list):
                raise ProfileError(f"'scores' must be null or a list of [layer, kv_head, ts], found {d['scores']!r}")
            scores = {}
            for row in d["scores"]:
                if not isinstance(row, list) or len(row) != 3:
                    raise ProfileError(f"'scores' entries must be [layer, kv_head, ts], found {row!r}")
                k = _head(row[:2], "scores entry")
                if k in scores:
                    raise ProfileError(f"'scores' lists head {k} twice")
                scores[k] = row[2]
        if not isinstance(d["provenance"], dict):
            raise ProfileError(f"'provenance' must be a JSON object, found {type(d['provenance']).__name__}")
        return cls(ModelIdentity.from_dict(d["model"]), frozenset(heads), scores, d["provenance"], v, d.get("settings"))

    def to_json(self) -> str:
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        # One [l, h] / [l, h, ts] row per line keeps shipped profiles readable and diffable.
        num = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
        row = re.compile(rf"\[\s*({num}),\s*({num})(?:,\s*({num}))?\s*\]")
        return row.sub(lambda m: "[" + ", ".join(g for g in m.groups() if g is not None) + "]", text) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ProfileError(f"no head profile file at {path}; check the path or use a profile name") from e
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProfileError(f"cannot read head profile {path}: {e}") from e
        try:
            return cls.from_dict(data)
        except ProfileError as e:
            raise ProfileError(f"{path}: {e}") from None

    # ---- constructors --------------------------------------------------------
    @classmethod
    def all_stable(cls, config: Any) -> HeadProfile:
        return cls(_identity(config), frozenset(), provenance={"kind": "all_stable"})

    @classmethod
    def all_unstable(cls, config: Any) -> HeadProfile:
        m = _identity(config)
        heads = frozenset((l, h) for l in range(m.num_layers) for h in range(m.num_kv_heads))
        return cls(m, heads, provenance={"kind": "all_unstable"})

    @classmethod
    def from_unstable(cls, config: Any, heads: Iterable, provenance: Mapping | None = None) -> HeadProfile:
        return cls(_identity(config), frozenset(_head(h, "head") for h in heads),
                   provenance=dict(provenance) if provenance is not None else {"kind": "manual"})

    @staticmethod
    def _count(m: ModelIdentity, fraction: float) -> int:
        if not _is_number(fraction) or not 0.0 <= fraction <= 1.0:
            raise ProfileError(f"fraction must be a number in [0, 1], found {fraction!r}")
        return round(fraction * m.num_layers * m.num_kv_heads)

    @classmethod
    def random(cls, config: Any, fraction: float = 0.25, seed: int = 0) -> HeadProfile:
        """A control profile: exactly round(fraction * L * H) heads, chosen by ``seed``."""
        m = _identity(config)
        k = cls._count(m, fraction)
        every = [(l, h) for l in range(m.num_layers) for h in range(m.num_kv_heads)]
        chosen = _random.Random(seed).sample(every, k)
        return cls(m, frozenset(chosen), provenance={"kind": "random", "fraction": fraction, "seed": seed})

    @classmethod
    def from_scores(cls, config: Any, scores: Mapping, fraction: float = 0.25,
                    provenance: Mapping | None = None) -> HeadProfile:
        """Mark the ``fraction`` of heads with the lowest TS (least stable) unstable.

        Every head must be scored: an unscored head cannot be ranked.  Ties are
        broken by (layer, head) so the result never depends on dict order.
        """
        m = _identity(config)
        k = cls._count(m, fraction)
        if not isinstance(scores, Mapping):
            raise ProfileError(f"scores must map (layer, kv_head) -> float, found {type(scores).__name__}")
        clean = {_head(h, "scores key"): v for h, v in scores.items()}
        _check_every_head_scored(m, clean)
        prov = dict(provenance) if provenance is not None else {"kind": "scores"}
        prov.setdefault("fraction", fraction)
        tmp = cls(m, frozenset(), clean, prov)  # validates the scores before ranking them
        ranked = sorted(tmp.scores.items(), key=lambda kv: (kv[1], kv[0]))
        return cls(m, frozenset(h for h, _ in ranked[:k]), tmp.scores, prov)


# ---- finding shipped profiles ------------------------------------------------
def shipped_profiles_dir() -> Path:
    """The shipped profiles: the package's resource folder ``flexicache_hf/profiles`` (in a checkout a link to the
    top-level ``profiles/``, in a wheel a copy made at build time), else the top-level folder beside the package."""
    packaged = resources.files(__name__.partition(".")[0]) / "profiles"
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "profiles"


def _profiles_dir(profiles_dir: str | os.PathLike | None) -> Path:
    return shipped_profiles_dir() if profiles_dir is None else Path(profiles_dir)


def available_profiles(profiles_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Profile files by stem, e.g. ``{"Llama-3.1-8B-Instruct": Path(...)}``."""
    d = _profiles_dir(profiles_dir)
    if not d.is_dir():
        return {}
    return {p.stem: p for p in sorted(d.glob("*.json"))}


def _check_every_head_scored(m: ModelIdentity, scores: Mapping) -> None:
    """Refuse scores that leave a head of ``m`` unscored (an unscored head cannot be ranked)."""
    missing = {(l, h) for l in range(m.num_layers) for h in range(m.num_kv_heads)} - set(scores)
    if missing:
        raise ProfileError(f"scores must cover all {m.num_layers}x{m.num_kv_heads} heads; "
                           f"{len(missing)} have no score, e.g. {min(missing)}")


def resolve_profile(spec: Any, *, profiles_dir: str | os.PathLike | None = None) -> HeadProfile:
    """A HeadProfile from a profile, a JSON path, or a model name.

    A name matches a shipped profile by file stem, by the model name recorded in
    it (``meta-llama/Llama-3.1-8B-Instruct``) or by that name's last component;
    case is ignored, as on the hub.  A string naming an existing file is a path.
    """
    if isinstance(spec, HeadProfile):
        return spec
    if isinstance(spec, os.PathLike):
        return HeadProfile.load(spec)
    if not isinstance(spec, str) or not spec:
        raise ProfileError(f"expected a HeadProfile, a JSON path or a model name, found {spec!r}")
    if Path(spec).is_file():
        return HeadProfile.load(spec)
    found = available_profiles(profiles_dir)
    names = ", ".join(found) or f"none (no *.json in {_profiles_dir(profiles_dir)})"
    if spec.endswith(".json"):
        raise ProfileError(f"no head profile file at {spec}; available profile names: {names}")
    want = spec.rstrip("/").casefold()
    want_last = want.rsplit("/", 1)[-1]
    for stem, path in found.items():
        if stem.casefold() in (want, want_last):
            return HeadProfile.load(path)
    unreadable = []  # a broken file in the folder does not hide the others (named below if nothing matched)
    for stem, path in found.items():
        try:
            prof = HeadProfile.load(path)
        except ProfileError as e:
            unreadable.append(str(e))  # (names the file)
            continue
        name = (prof.model.name or "").casefold()
        if name and (want == name or want_last == name.rsplit("/", 1)[-1]):
            return prof
    skipped = f"; skipped unreadable profile files: {'; '.join(unreadable)}" if unreadable else ""
    raise ProfileError(f"no head profile named {spec!r}; available profile names: {names} "
                       f"(or pass a path to a profile JSON file){skipped}")
