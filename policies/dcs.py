"""Policy ``dcs`` (AdaptiveSpec's Draft Confidence Score tree policy) — being implemented."""
