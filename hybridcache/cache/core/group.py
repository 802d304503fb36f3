"""`CacheGroup`: the cache layers of one decoder layer by member name (FalconH1's attention and mamba)."""

from __future__ import annotations

from collections.abc import Mapping

from hybridcache.cache.core.base import CacheLayer


class CacheGroup(Mapping[str, CacheLayer]):
    """The cache layers of one decoder layer, by member name: `group["attention"]` or `group.attention`."""

    def __init__(self, members: Mapping[str, CacheLayer]) -> None:
        self._members = dict(members)

    def __getitem__(self, name: str) -> CacheLayer:
        try:
            return self._members[name]
        except KeyError:
            raise KeyError(f"this cache group has members {', '.join(self._members)}, not {name!r}") from None

    def __getattr__(self, name: str) -> CacheLayer:
        members = self.__dict__.get("_members", {})
        if name in members:
            return members[name]
        raise AttributeError(f"this cache group has members {', '.join(members)}, not {name!r}")

    def __iter__(self):
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __repr__(self) -> str:
        return "CacheGroup(" + ", ".join(f"{k}={v!r}" for k, v in self._members.items()) + ")"


Entry = CacheLayer | CacheGroup
