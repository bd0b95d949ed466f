"""Tests of the node daemon: CRIU, /proc discovery, jobs, stamps."""
