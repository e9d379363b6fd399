"""Code that both the gateway and the workers import: wire schema, Redis key names,
settings, logging, errors and the model repository. Nothing here imports gateway/ or
workers/."""
