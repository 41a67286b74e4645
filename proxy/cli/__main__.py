"""``python -m proxy.cli``: the same as ``radixctl``."""

from proxy.cli.main import main

main()
