"""Verifier ``margin`` (AdaptiveSpec's margin rule) — being implemented."""
