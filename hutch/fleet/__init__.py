"""hutch on a Ray cluster: one hutch daemon per Ray node, behind the same SDK (docs/fleet.md).

    hutch fleet up --ray auto          # or hutch.fleet.up("auto")
    export HUTCH_URL=ray://auto        # or hutch.connect("ray://head:10001")

`up` starts the controller (a named, detached actor: _controller.py), which starts an agent on every Ray node
(_agent.py) that runs that node's daemon. Callers place and reach sandboxes themselves (hutch/sandbox/_fleet.py).
`memory(name, remote=...)` is a memory store shared by the cluster: one writer actor, a git remote as the
truth, a reader on every node (_memstore.py; the handle: _memory.py).
Needs `pip install 'hutch[ray]'`; a single host needs none of this.
"""

from hutch.fleet._memory import FleetMemory, init_remote, memory, memory_down
from hutch.fleet._ops import cordon, down, ls, up

__all__ = ["FleetMemory", "cordon", "down", "init_remote", "ls", "memory", "memory_down", "up"]
