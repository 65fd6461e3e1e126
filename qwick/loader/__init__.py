"""Model loading: GGUF files to Hugging Face directories, and the built-in demo model."""
