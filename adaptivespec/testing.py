"""pytest plugin with fixtures for adaptivespec plugin authors (loaded through ``pytest11``)."""
