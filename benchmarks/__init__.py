"""meshtrain's benchmarks against its peers (run ``python -m benchmarks --help``)."""
