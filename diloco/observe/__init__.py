"""What a run reports: goodput, uptime, staleness and the bandwidth ledger from its tape and
activity records (`accounting`), how faithfully its rounds merged (`fidelity`), the timeline
plots (`timeline`), and the scalar writers (`metrics`)."""
