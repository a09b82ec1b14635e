"""Import-time stand-ins for CUDA-only packages; see cpu_support.py. Never imported as a package."""
