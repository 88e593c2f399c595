"""The bootstrap protocol between a decode server and a prefill server (plain JSON over HTTP; no jax here).

1. The decode server asks `GET /disagg/info` once per prefill server: the KV layout there (`KVLayout`), which must
   equal its own (page size, layers, unique KV heads, head size, dtype; TP degrees may differ).
2. For each request it `POST`s a `PrefillRequest` to `/disagg/prefill`: the prompt's token ids and the sampling
   parameters that draw the first token (the seed fixed by the decode side, so both draw one stream).
3. The prefill server runs the prompt (chunked, prefix-cached), gathers the prompt's KV pages into one block, offers
   it to its transfer server under a fresh uuid (held until pulled or `timeout_s` passes), and answers a
   `PrefillResponse`: the first token, its logprobs, and a `KVHandle` (where and what to pull). With `chunked`, the
   answer is NDJSON: after each prefill step, a line `{"chunk": handle}` offers the pages that step completed, so
   the decode side pulls them while later chunks compute; the last line is `{"done": response}` (or `{"error"}`).
4. The decode server pulls the blocks with `jax.experimental.transfer`, writes them into its own pool, and decodes.

The router names the prefill servers a request may use in the `X-Jaxserve-Prefill` header (comma-separated base
URLs, tried in order); a decode server without one falls back to its `--prefill-url`s, then to prefilling locally.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jaxserve.core.sampling_params import SamplingParams

PREFILL_HEADER = "x-jaxserve-prefill"
INFO_PATH = "/disagg/info"
PREFILL_PATH = "/disagg/prefill"
UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "[::]", "")

# SamplingParams fields the prefill side needs to draw the first token as the colocated engine would.
_FIRST_TOKEN_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "logprobs",
                       "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                       "bad_words", "stop_token_ids")


@dataclass(frozen=True)
class KVLayout:
    """What a KV block looks like on one server; two servers exchange blocks only when their layouts are equal."""

    model: str
    num_layers: int
    page_size: int
    num_kv_heads: int  # the model's own KV heads (a block never carries TP replicas)
    head_dim: int
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVLayout:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field that differs, as a one-line reason; None when blocks can move between the two."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                return f"{f.name} differs: {theirs!r} on the prefill server, {mine!r} here"
        return None


@dataclass(frozen=True)
class KVHandle:
    """Where one prompt's KV block waits: the transfer server's address, the uuid, the block's shape and dtype."""

    address: str
    uuid: int
    shape: tuple[int, ...]
    dtype: str
    num_tokens: int  # the prompt's tokens whose KV is in the pages up to this block's last
    first_page: int = 0  # where the block's pages go in the request's page table
    num_pages: int = 0  # pages of the block that hold KV (the rest pad it to a bucket)

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "uuid": self.uuid, "shape": list(self.shape), "dtype": self.dtype,
                "num_tokens": self.num_tokens, "first_page": self.first_page, "num_pages": self.num_pages}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVHandle:
        return cls(str(d["address"]), int(d["uuid"]), tuple(int(x) for x in d["shape"]), str(d["dtype"]),
                   int(d["num_tokens"]), int(d.get("first_page", 0)), int(d.get("num_pages", 0)))

    def reachable_from(self, prefill_host: str) -> KVHandle:
        """This handle with an unspecified bind host (0.0.0.0, ::) replaced by the host the decode side used to
        reach the prefill server's HTTP port: a server bound to every interface advertises no usable host."""
        host, _, port = self.address.rpartition(":")
        if host not in UNSPECIFIED_HOSTS:
            return self
        return dataclasses.replace(self, address=f"{prefill_host}:{port}")


@dataclass(frozen=True)
class PrefillRequest:
    """What the decode side sends: the prompt and the first token's sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    cache_salt: str | None = None
    chunked: bool = False  # offer each prefill chunk's full pages as they are computed (an NDJSON answer)

    @classmethod
    def of(cls, request_id: str, ids: list[int], params: SamplingParams, cache_salt: str | None,
           chunked: bool = False) -> PrefillRequest:
        fields = {name: getattr(params, name) for name in _FIRST_TOKEN_FIELDS}
        if fields["logit_bias"]:
            fields["logit_bias"] = {str(k): v for k, v in fields["logit_bias"].items()}
        return cls(request_id, list(ids), fields, cache_salt, chunked)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PrefillRequest:
        ids = d.get("prompt_token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        params = d.get("params") or {}
        if not isinstance(params, dict) or set(params) - set(_FIRST_TOKEN_FIELDS):
            raise ValueError(f"params may hold only {', '.join(_FIRST_TOKEN_FIELDS)}")
        return cls(str(d.get("request_id", "")), ids, params, d.get("cache_salt"), bool(d.get("chunked", False)))

    def sampling_params(self) -> SamplingParams:
        """The prefill side's parameters: the first token only (max_tokens 1), drawn as the decode side would."""
        fields = dict(self.params)
        if fields.get("logit_bias"):
            fields["logit_bias"] = {int(k): float(v) for k, v in fields["logit_bias"].items()}
        return SamplingParams(max_tokens=1, **fields)


@dataclass(frozen=True)
class PrefillResponse:
    """The prefill side's answer: the first token, its logprobs entry (or None), and where its KV waits."""

    first_token: int
    logprobs: dict[int, float] | None
    kv: KVHandle | None  # the (last) block to pull; None when every block was announced before (chunked)

    def to_json(self) -> dict[str, Any]:
        lp = None if self.logprobs is None else {str(k): v for k, v in self.logprobs.items()}
        return {"first_token": self.first_token, "logprobs": lp, "kv": None if self.kv is None else self.kv.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PrefillResponse:
        lp = d.get("logprobs")
        return cls(int(d["first_token"]), None if lp is None else {int(k): float(v) for k, v in lp.items()},
                   None if d.get("kv") is None else KVHandle.from_json(d["kv"]))


def remote_prefill_supported(params: SamplingParams) -> bool:
    """Whether a request can be prefilled on another server: not with a structured-output constraint (the grammar
    lives here) nor prompt logprobs (the prefill side keeps no prompt rows); those prefill locally."""
    return params.structured_outputs is None and params.prompt_logprobs is None and params.n == 1
