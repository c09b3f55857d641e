"""Benchmark definitions and result rendering (tables, JSON, CSV, plots).

Empty for now: the scaling, allreduce, overhead and checkpoint benchmarks
arrive with the benchmark work; they will drive training through
launcher.driver.launch like any other run.
"""
