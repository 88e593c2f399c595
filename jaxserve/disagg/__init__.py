"""Disaggregated serving across processes: prefill and decode servers, KV moved by `jax.experimental.transfer`.

`roles.py` builds a server's engine and app for its `--disaggregation-mode`; `protocol.py` is the bootstrap
handshake (plain JSON); `transfer.py` the transfer endpoint; `kv_export.py` the prefill side, `kv_import.py` and
`remote_prefill.py` the decode side. docs/disaggregation.md says how to run it.
"""
