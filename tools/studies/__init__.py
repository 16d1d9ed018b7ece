"""Simulator studies that only benchmarks and their tests run, on the product's simulator (marlaas_hpc/sim/):

    multiplex.py   K models' jobs on one shared rollout pool (the ModelPool policy) against dedicated pools
    coresident.py  the same pool with every model's engine awake on every GPU
    tails.py       what long completions cost (decode time per running batch size, dropped groups)
    repack.py      Laminar's repack: long tails handed to tail rollout ranks
    calibrate.py   a workload fitted to measured runs (tools/calibrate.py)

Importable as `studies.*` with tools/ on sys.path (each tools/ script has it; tests/conftest.py adds it).
"""
