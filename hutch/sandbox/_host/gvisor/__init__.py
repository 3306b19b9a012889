"""The gVisor runtime (`runtime="gvisor"`): sandboxes under runsc, with memory snapshots, restore and fork.

runsc.py: the runsc binary (its version, flags, calls) and the OCI bundle of a sandbox; keeper.py: the
process each sandbox's runsc runs under (standard library only); runtime.py: the daemon's side (start,
exec, files, pause, checkpoint, restore, teardown); snapshots.py: memory snapshots on disk.
"""
