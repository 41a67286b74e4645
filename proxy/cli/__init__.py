"""``radixctl``: the command line (build, model, patch, serve, up, inspect, doctor, bench)."""
