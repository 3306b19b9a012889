"""The sandbox wing: isolated, ephemeral Linux environments. Never imports hutch.memory.

Cut by the process the code runs in (docs/architecture.md has the map): the modules here run in the
caller's process (the SDK) or are the contract both sides share (_spec, _api); _host/ runs on the host as
root (the daemon, the zygote and inits, the egress gateway); _inside/ runs inside a sandbox.
"""
