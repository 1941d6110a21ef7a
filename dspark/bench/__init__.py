"""Benchmarks: every speed claim of the project is produced by a command in here."""
