"""Kernel backends: code generation, compilation, running and timing."""
