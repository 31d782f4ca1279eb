"""What the faces (cli, api, dashboard) call beyond the job path: a pull request's check of a
build against its baseline (check) and the embedded stack's processes (stack)."""
