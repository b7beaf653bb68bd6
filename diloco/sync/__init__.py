"""The syncer: collects deliveries, decides rounds (quorum, grace), merges, steps G.

`syncer` runs the rounds; `outer_state` holds G and takes the outer step, `rejections` keeps
what it refuses, `round_timing` the grace window's moving averages."""
