"""The model side: lane reader, continuous-batching core, sampling, detokenizer,
engine backends and the worker process."""
