"""`qwick bench`: the benchmark workloads, each beside transformers on the same weights."""
