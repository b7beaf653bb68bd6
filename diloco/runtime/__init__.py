"""The single-controller (Pathways-style) runtime: one process, one mesh per learner.

`core` builds the learner slots, the syncer and the in-memory transport; `drivers` move time
over them (threads on the wall clock, or a deterministic virtual clock); `faults` are the
cooperative fault schedules; `checkpoint` makes runs durable; `decoupled` is the entry point
that `python -m diloco.main` calls."""
