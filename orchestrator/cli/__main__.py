"""`python -m orchestrator.cli`: the farm CLI, how the embedded stack starts its processes."""

from orchestrator.cli import main

main()
