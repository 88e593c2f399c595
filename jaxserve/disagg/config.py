"""`DisaggregationConfig`: a server's disaggregation flags, checked once (no jax: the CLI imports it first)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.engine import EngineConfig

MODES = ("prefill", "decode")


@dataclass(frozen=True)
class DisaggregationConfig:
    """The serve command's disaggregation flags."""

    mode: str | None = None  # None, "prefill" or "decode"
    transfer_port: int = 0
    kv_transfer_timeout: float = 60.0  # seconds an offered block waits for its pull; a decode's wait per server
    prefill_urls: tuple[str, ...] = ()  # a decode server's prefill servers when the router names none
    chunked_transfer: bool = True  # a decode server asks for each prefill chunk's pages as they are computed

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"--disaggregation-mode must be null, prefill or decode, got {self.mode!r}")
        if self.prefill_urls and self.mode != "decode":
            raise ValueError("--prefill-url is for --disaggregation-mode decode")
        if self.kv_transfer_timeout <= 0:
            raise ValueError("--kv-transfer-timeout must be positive")

    def check(self, config: EngineConfig) -> None:
        """Refuse what a role cannot run with (ValueError, one line)."""
        if self.mode is None:
            return
        if config.disaggregate or config.num_processes > 1:
            raise ValueError("--disaggregation-mode runs one engine per process (not with --disaggregate or several "
                             "processes)")
        if config.kv_cache_dtype != "auto":
            raise ValueError("--disaggregation-mode moves float pages: use --kv-cache-dtype auto")
        if self.mode == "decode" and (config.async_scheduling or config.num_scheduler_steps > 1
                                      or config.speculative_config):
            raise ValueError("a decode server runs the synchronous loop (no async scheduling, multi-step or "
                             "speculation yet)")
