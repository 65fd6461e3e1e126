"""User-facing entry points: the offline `LLM` and the `qwick` command line."""
