"""Speculative decoding: drafters that propose tokens, verified by the target model in one step.

`ngram.py` drafts on the host from the request's own tokens (prompt lookup); `draft_heads.py` drafts on
the device from the target's last hidden state. Verification (jax_engine's verify program,
sampling.verify_drafts) accepts a prefix of the drafts per request so that greedy output is the
target's own and sampled output keeps the target's distribution exactly.
"""
