"""Benchmarks run by ``leancompile bench NAME``: ratios measured in one run, printed."""

__all__: list[str] = []
