"""``radixctl bench``: workloads, arms (nocache, legacy, proxy), a runner, reports, replay."""
