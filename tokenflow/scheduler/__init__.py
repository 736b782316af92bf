"""The step loop's scheduler: continuous batching (`schedule` / `update_from_output`), static `hf` batches,
n-gram drafts."""
