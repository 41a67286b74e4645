"""Traffic the bench and the workbench share, below both: seeded text generation, the
fictional company data, the workload spec, and the runner that sends requests and writes and
replays manifests. It reaches the proxy over HTTP only."""
