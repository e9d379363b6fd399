"""Project scripts: benchmarks, model generators and the GPU check, run from the repository
root as modules (``python -m scripts.bench_fleet``) against the installed ``streamfleet``."""
