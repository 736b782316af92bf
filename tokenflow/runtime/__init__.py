"""What runs on the model thread: model loading, backends, the paged runner, attention variants, the sampler."""
