"""jspec's benchmarks: one module per benchmark, run from the repo root as
`python -m benchmarks.<name>`; what they share is in benchmarks/common.py."""
