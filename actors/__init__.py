"""Thin Ray actor wrappers around sync_service components (trainer shards, rollout engines)."""
