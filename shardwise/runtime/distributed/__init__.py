"""Process groups: the parallel mesh, counted and error-naming collectives, start-up agreement."""
