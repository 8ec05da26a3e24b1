"""Benchmarks: timings and memory printed as tables and written as JSON; never tests."""
