"""The device side: `farm-agent` runs jobs with the engine on a phone or GPU host. It imports
the engine and never the orchestrator."""
