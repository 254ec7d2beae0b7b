"""Built-in candidate sources, each registered as a plugin exactly as an outside one is."""
