"""ops: running the workflow: the environment check (environment), status of a run (status, status_view, jobs),
the dry-run summary, retraining one node (retrain)."""
