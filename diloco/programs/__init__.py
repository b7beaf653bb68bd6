"""Readers of compiled programs: what XLA emitted (dots, scatters, residuals, buffer reads,
collectives), for the tests and benchmarks that check the program rather than the Python, and
for `diloco compile`'s report on a TPU topology."""
