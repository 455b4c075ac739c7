"""A run's checkpoints over time: how a run directory is named (run_layout) and when a checkpoint in it is whole
(units), `list` with sizes (listing, sizes, run_metrics), the retention policy (retention), `prune`, `thin`
(thinning, thin_objects for object storage) and `watch` (watching, watch_state)."""
