"""Built-in tree policies, each registered as a plugin exactly as an outside one is."""
