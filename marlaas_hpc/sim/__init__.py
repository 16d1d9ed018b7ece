"""Discrete-event simulator of a whole job: the real scheduler against simulated ranks (docs/architecture.md §11).

    workload.py  stage-cost model, YAML with units      setup.py   layout and tasks (from a job config)
    engine.py    event queue and simulated ranks          report.py  summary, figures, timeline
"""
