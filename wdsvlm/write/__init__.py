"""Writing datasets: inputs, shard writing, engines (local and Ray), indexing existing tars."""
