"""``radixctl``: build, fetch, serve, and inspect.

Every command is defined at module level in its own module; this one only gathers them under
the ``main`` group (``RADIX_`` is the prefix of every option's environment variable).
"""

from __future__ import annotations

import click

from proxy.bench.cli import bench
from proxy.cli.build import build, model, patch
from proxy.cli.doctor import doctor
from proxy.cli.inspect import routes, slots, stats, tree
from proxy.cli.serve import serve, up
from proxy.sim.cli import sim
from proxy.workbench.cli import workbench


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "RADIX"})
def main() -> None:
    """llama-radix-proxy: a KV-cache reuse layer in front of llama-server."""


main.add_command(build)
main.add_command(model)
main.add_command(patch)
main.add_command(serve)
main.add_command(up)
main.add_command(routes)
main.add_command(tree)
main.add_command(slots)
main.add_command(stats)
main.add_command(doctor)
main.add_command(bench)
main.add_command(sim)
main.add_command(workbench)

if __name__ == "__main__":
    main()
