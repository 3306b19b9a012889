"""The `native` sandbox runtime: Linux namespaces, overlayfs, cgroups, seccomp.

Layout (the zygote imports only the stdlib-only modules marked *):
  _linux.py*    ctypes wrappers for the syscalls Python lacks (mount, pivot_root, clone, capset, seccomp)
  _seccomp.py*  the seccomp filter, hand-assembled classic BPF, built once per daemon
  _zygote.py*   the start server (it clone()s each sandbox's init, pid 1 of the sandbox)
  _wire.py*     the JSON + SCM_RIGHTS messages between the daemon, the zygote and the inits
  _init.py*     a sandbox's init: root, lockdown, exec and file calls
  _cgroups.py   cgroup v1 (hybrid) and v2 limits, kill and removal, done by the daemon
  _idmap.py     the user namespace (default): a host id range per sandbox, id maps, the idmap probe
  _runtime.py   the daemon side: spawns the zygote, starts sandboxes, talks to their inits
"""
