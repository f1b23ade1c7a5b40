"""Speculative decoding: proposers (n-gram lookup, draft model) and verification bookkeeping.

Ranks above models and below worker: it may use models, layers, sample and attention."""
