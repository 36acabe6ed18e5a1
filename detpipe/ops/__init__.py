"""Running the pipeline for a flow run or a team: processes bound to a run, params overrides, isolated workspaces, the team's remotes, repository repair, partial commits."""
