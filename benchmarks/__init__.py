"""Benchmark definitions and result rendering (tables, JSON, CSV, plots).

Empty for now: the scaling, allreduce, overhead and checkpoint benchmarks
arrive with the benchmark work; they will drive training through
the launcher's public API (``launcher``, ``launcher.driver``, ...) like any other run.
"""
