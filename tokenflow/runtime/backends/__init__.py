"""Model backends (entry-point group `tokenflow.backends`): `paged` (default) and `hf` (static batches)."""
