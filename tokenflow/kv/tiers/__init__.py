"""KV tiers below the prefix cache: the tier base (load jobs, write-behind) and the disk tier."""
