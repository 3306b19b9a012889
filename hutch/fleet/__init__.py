"""hutch on a Ray cluster: one hutch daemon per Ray node, behind the same SDK (docs/fleet.md).

    hutch fleet up --ray auto          # or hutch.fleet.up("auto")
    export HUTCH_URL=ray://auto        # or hutch.connect("ray://head:10001")

`up` starts the controller (a named, detached actor: _controller.py), which starts an agent on every Ray node
(_agent.py) that runs that node's daemon. Callers place and reach sandboxes themselves (hutch/sandbox/_fleet.py).
Needs `pip install 'hutch[ray]'`; a single host needs none of this.
"""

from hutch.fleet._ops import cordon, down, ls, up

__all__ = ["cordon", "down", "ls", "up"]
