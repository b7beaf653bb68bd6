"""The multi-process runtime: learners and the syncer as separate processes (and hosts) that
exchange Orbax-serialised fragments through a store, a local directory or a `gs://` bucket.

`store` and `npy_handler` are the on-disk layout; `store_transport` the learner's and the
syncer's links over it; `hosts` a learner spanning several hosts; `wan` the emulated
wide-area link; `learner_process` and `syncer_process` the two roles; `launcher` runs them
locally, and `chaos` kills and stops them with real signals; `jobset` renders the GKE manifest
that runs them on a cluster (`scripts/make_jobset.py`)."""
