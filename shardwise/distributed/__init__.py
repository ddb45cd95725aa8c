"""Process groups and the counted, error-naming collectives every stage uses."""
