"""The asynchronous SAO pipeline: ready buffer, rollout service, weight sync, driver."""
