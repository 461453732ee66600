"""Value pretraining at scale: a sharded rollout corpus (`generate`), the critic trained on it by
streamed row groups with exact resume (`train`), held-out explained variance and calibration."""
