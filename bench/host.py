"""One host of a world across hosts: start its ranks, wait for them, bounded.

``run_world`` (world.py) starts this script once per host, inside the host's network
and PID namespaces (see placement.py); it starts the host's ranks as processes of its
own, so they share the host's mount namespace. Usage (not for people)::

    python bench/host.py <world tmp dir> <ranks, e.g. 0,2> <init_method>
"""

from __future__ import annotations

import sys

import world

if __name__ == "__main__":
    sys.exit(world.host_main(sys.argv[1:]))
