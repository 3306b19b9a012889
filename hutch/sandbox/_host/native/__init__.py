"""The `native` sandbox runtime: Linux namespaces, overlayfs, cgroups, seccomp.

Layout (the zygote and each init run only the modules marked *, which import only the standard library):
  linux.py*     ctypes wrappers for the syscalls Python lacks (mount, pivot_root, clone, capset, seccomp)
  zygote.py*    the start server (it clone()s each sandbox's init, pid 1 of the sandbox)
  initwire.py*  the JSON + SCM_RIGHTS messages between the daemon, the zygote and the inits
  init.py*      a sandbox's init: root, lockdown, exec and file calls
  seccomp.py    the seccomp filter, hand-assembled classic BPF, built once per daemon (stdlib only too)
  cgroups.py    cgroup v1 (hybrid) and v2 limits, kill and removal, done by the daemon
  disk.py       the store of writable layers (btrfs, a quota per sandbox), done by the daemon
  plan.py       a sandbox's run plan (a frozen value the init gets as a dict), id maps of its binds
  idmap.py      the user namespace (default): a host id range per sandbox, id maps, the idmap probe
  runtime.py    the daemon side: spawns the zygote, starts sandboxes, talks to their inits
"""
