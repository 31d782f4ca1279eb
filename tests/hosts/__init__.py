"""A farm of several hosts on this machine, through real network boundaries: network namespaces
and veth pairs made with iproute2 (netns.py), private Redis and PostgreSQL servers
(servers.py), and the farm's own processes in them (farm.py). What the multi-host tests
(tests/orchestrator/test_hosts.py) and the fault suite's `--hosts` scenario run on."""
