"""Checkpoints: the coordinator's rounds, their metadata, the durable storage tier
and statistics (internal; configured through ``rayflow.config.CheckpointConfig``)."""
