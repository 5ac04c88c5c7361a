"""Performance instruments: timers, memory logging, memory snapshots."""
