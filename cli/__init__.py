"""The roof: the `phasescope` command line (`main`; `analyze` for diagnose, plan-kv and compare;
`deploy` for run, health and retention) and the demo (`demo`, `serve_demo`).

The one place that wires everything together: it imports the agent, analyzers, exporters and
dashboard; nothing imports it. `python -m phasescope.cli ...` runs the command line.
"""
