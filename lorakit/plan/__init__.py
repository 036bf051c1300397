"""What a run does on this machine: the memory plan and estimate (`memory`), compile, CUDA graphs and attention
(`decide`), and `resolve`, which completes a run's config once."""
