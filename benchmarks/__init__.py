"""The layernorm benchmark: layernorm against torch, a NumPy formula and a plain copy of the same
bytes.  Run it from the repository root with ``python -m benchmarks`` (``--help`` says how it
measures).

Modules: cases (what is measured), timing (how a call is timed), peers (what ours is compared
with), references (the float64 ground truth), measure (check, then time), report (Markdown),
plot (matplotlib, optional).
"""
