"""Candidate fusion groups: what may be one kernel, and why not."""
