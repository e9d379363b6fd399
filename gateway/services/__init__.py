"""What several doors use (docs/architecture.md, "Module map"): many requests over one
connection, speech (voice activity, audio files, utterances), embeddings."""
