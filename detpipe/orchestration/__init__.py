"""Running the pipeline for a flow run or a team: processes bound to a run, params overrides, isolated workspaces,
DVC experiments, the team's remotes, Prefect deployments, repository repair, partial commits."""
