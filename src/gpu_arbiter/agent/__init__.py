"""The worker agent: GPU probes, heartbeat, process supervision."""
