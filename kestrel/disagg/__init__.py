"""Prefill/decode disaggregation: a prefill instance computes a prompt and its first token, then hands the request's
caches (MLA latent pages with indexer keys, every KDA layer's conv and recurrent state) to a decode instance, which
continues it. The protocol is SGLang's as its router speaks it: the router sends the same request to both, with
bootstrap_host, bootstrap_port and bootstrap_room; the decode instance fetches room's handoff from the prefill
instance's bootstrap port (outbox.py keeps it there, transport.py moves it, wire.py checksums every tensor)."""
