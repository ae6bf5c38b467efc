"""Issue 48: the sections of benchmarks/gpu_check.py that round 2 added, one module each."""
