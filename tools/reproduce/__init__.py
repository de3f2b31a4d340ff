"""The paper's tables and plots, reproduced from runs of this project: `python -m tools.reproduce
all` (or `make reproduce`) writes results/REPORT.md, one CSV per table and the PNG plots.

    cluster.py   the 32-GPU analytical setup (GPT 1.3B-13B on H200s) and its recovery cases
    traces.py    failure traces: fixed intervals (Oobleck's) and Poisson, with rejoins
    simulate.py  event-driven training time under a trace, one recovery policy at a time
    runs.py      real CPU runs under chameleon-launch with an injected kill
    benches.py   plan-search time and the fused-communication ablation (tools/bench)
    tables.py    the six tables, each a report section with its CSVs and plots
    plots.py     the PNGs (matplotlib, Agg)
    report.py    sections, CSVs and REPORT.md
"""
