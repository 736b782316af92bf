"""The `tokenflow bench*` commands: each prints a table and writes JSON."""
