"""The multi-process runtime: learners and the syncer as separate processes (and hosts) that
exchange Orbax-serialised fragments through a store, a local directory or a `gs://` bucket.

`store/` is the on-disk layout, a package of its own below everything else here (`Store` and
its parts `blob_io`, `payload_box`, `merged_versions`, `learner_registry`, `run_lifecycle`,
named by `names`; checked entries `entry_check`, `npy_handler`; the syncer `lease`; the
run's `layout` and commit `markers`; G read back, `global_view`); `learner_link` and
`syncer_link` are the learner's and the syncer's links over it, `process_hooks` a run's
`log.hooks` across processes; `hosts` a
learner spanning several hosts; `wan` the emulated wide-area link; `learner_process` and
`syncer_process` the two roles; `launcher` runs them locally (`supervision` its processes,
`launch_report` the end-of-run report), and `chaos` kills and stops them with real signals;
`jobset` renders the GKE manifest that runs them on a cluster (`scripts/make_jobset.py`)."""
