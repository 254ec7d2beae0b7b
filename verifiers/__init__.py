"""Built-in verifiers, each registered as a plugin exactly as an outside one is."""
