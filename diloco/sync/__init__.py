"""The syncer: collects deliveries, decides rounds (quorum, grace), merges, steps G."""
