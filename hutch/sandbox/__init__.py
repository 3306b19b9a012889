"""The sandbox wing: isolated, ephemeral Linux environments. Never imports hutch.memory."""
