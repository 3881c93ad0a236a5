"""A profile's settings, and the one place a cache's settings are resolved.

A shipped profile carries the settings measured best for its model (:class:`ProfileSettings`: FlexiCacheConfig field
values, the unstable-head fraction the profile is cut to, and ``source``, the measurement that chose them).
:func:`resolve_settings` decides what a cache uses:

* ``config=`` given: that config, wholesale; the profile's heads as they are (no re-cut, no settings);
* otherwise the profile's settings (none: ``FlexiCacheConfig``'s own defaults) with keyword fields on top
  (``FlexiCache(profile, token_budget=1024)``), and the profile re-cut to the settings' unstable fraction.

``FlexiCacheConfig.paper()`` passed as ``config`` gives the paper's settings exactly.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .config import ConfigError, FlexiCacheConfig

CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(FlexiCacheConfig))
_OWN_KEYS = ("unstable_fraction", "source", "note")  # a settings object's keys besides FlexiCacheConfig's fields


class SettingsError(ConfigError):
    """A profile's ``settings`` object that cannot work (the profile's loader names the file)."""


@dataclass(frozen=True)
class ProfileSettings:
    """The settings a profile recommends for its model.

    Args:
        fields: ``FlexiCacheConfig`` field values (the rest stay at the config's defaults).
        source: where they were measured (a results folder or section of ``docs/benchmarks/accuracy.md``); required.
        unstable_fraction: the fraction of KV heads unstable, re-cut from the profile's per-head scores
            (``HeadProfile.least_stable``); ``None``: the profile's own set.
        note: free text, e.g. what the settings rest on when they were not measured on this model.
    """

    fields: tuple[tuple[str, Any], ...]
    source: str
    unstable_fraction: float | None = None
    note: str | None = None

    def __post_init__(self) -> None:
        items = dict(self.fields.items() if isinstance(self.fields, Mapping) else self.fields)
        unknown = sorted(set(items) - set(CONFIG_FIELDS))
        if unknown:
            raise SettingsError(f"settings names unknown FlexiCacheConfig fields {unknown}; "
                                f"known: {list(CONFIG_FIELDS)} and {list(_OWN_KEYS)}")
        try:
            FlexiCacheConfig(**items)  # every value checked as the config checks it
        except ConfigError as e:
            raise SettingsError(f"settings: {e}") from None
        object.__setattr__(self, "fields", tuple(sorted(items.items())))
        if not isinstance(self.source, str) or not self.source.strip():
            raise SettingsError(f"settings need a 'source' (the measurement that chose them), found {self.source!r}")
        f = self.unstable_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f)
                              or not 0 <= f <= 1):
            raise SettingsError(f"settings' unstable_fraction must be a number in [0, 1] or absent, found {f!r}")
        if self.note is not None and not isinstance(self.note, str):
            raise SettingsError(f"settings' note must be a string, found {self.note!r}")

    @property
    def config_fields(self) -> dict[str, Any]:
        return dict(self.fields)

    def config(self, **overrides) -> FlexiCacheConfig:
        """The config these settings give, ``overrides`` (single fields) on top.  A clash of an override with a
        field these settings set is refused naming those fields (the user set only the overrides)."""
        try:
            return FlexiCacheConfig(**{**self.config_fields, **overrides})
        except ConfigError as e:
            named = [f"{k}={v!r}" for k, v in self.fields
                     if k not in overrides and re.search(rf"\b{k}\b", str(e))]  # the settings' fields it names
            if not overrides or not named:
                raise
            raise ConfigError(f"{e} ({', '.join(named)}: the profile's settings; override that too, or pass "
                              "config=FlexiCacheConfig(...) to set every field)") from e

    def without_fraction(self) -> ProfileSettings:
        return dataclasses.replace(self, unstable_fraction=None)

    def to_dict(self) -> dict:
        d: dict[str, Any] = dict(self.fields)
        if self.unstable_fraction is not None:
            d["unstable_fraction"] = self.unstable_fraction
        d["source"] = self.source
        if self.note is not None:
            d["note"] = self.note
        return d

    @classmethod
    def from_dict(cls, d: Any) -> ProfileSettings:
        if not isinstance(d, Mapping):
            raise SettingsError(f"'settings' must be a JSON object or null, found {type(d).__name__}")
        d = dict(d)
        own = {k: d.pop(k) for k in _OWN_KEYS if k in d}
        if "source" not in own:
            raise SettingsError("settings need a 'source' (the measurement that chose them)")
        return cls(tuple(d.items()), **own)


def resolve_settings(profile, config: FlexiCacheConfig | None, fields: Mapping[str, Any]):
    """``(profile, config, source)`` a cache uses, from its ``profile`` (a HeadProfile), ``config=`` and keyword
    ``fields``; ``source``: where the settings came from (the profile's measurement, ``"config="`` or
    ``"FlexiCacheConfig defaults"``), with ``" + name=value"`` for each keyword field."""
    if config is not None:
        if fields:
            raise TypeError("pass either a FlexiCacheConfig or its fields as keywords, not both")
        if not isinstance(config, FlexiCacheConfig):
            raise TypeError(f"config must be a FlexiCacheConfig, got {type(config).__name__}")
        return profile, config, "config="
    settings = profile.settings
    if settings is None:
        source, config = "FlexiCacheConfig defaults", FlexiCacheConfig(**fields)
    else:
        source, config = settings.source, settings.config(**fields)
        if settings.unstable_fraction is not None:
            profile = profile.least_stable(settings.unstable_fraction)  # its settings keep no fraction: cut once
    extra = "".join(f" + {k}={v!r}" for k, v in fields.items())
    return profile, config, source + extra
