"""Cross-origin requests (vLLM's `--allowed-origins`, `--allowed-methods`, `--allowed-headers`,
`--allow-credentials`): browsers' preflights are answered before the API-key check, as vLLM does, since a
browser never sends credentials on a preflight."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CORSConfig:
    """What browsers of other origins may do; vLLM's defaults allow every origin, method and header."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def middleware_kwargs(self) -> dict[str, object]:
        """The keyword arguments of starlette's CORSMiddleware for this config."""
        return {"allow_origins": list(self.allowed_origins), "allow_methods": list(self.allowed_methods),
                "allow_headers": list(self.allowed_headers), "allow_credentials": self.allow_credentials}


__all__ = ["CORSConfig", "CORSMiddleware"]
