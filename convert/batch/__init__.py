"""``convert-bnb batch JOBS --out-dir DIR``: many conversions, resumable, failures isolated, on local
processes or a Ray cluster.

- :mod:`~convert.batch.cli`: the command line, the dry-run plan and the summary table;
- :mod:`~convert.batch.jobs`: the JOBS file (text, JSON or YAML) -> :class:`~convert.batch.jobs.Job`;
- :mod:`~convert.batch.run`: the parent: settings, the out-dir lock, the executors (local processes);
- :mod:`~convert.batch.worker`: one job in its worker (resume, convert, record, push);
- :mod:`~convert.batch.state`: a job's state file and the checks against it;
- :mod:`~convert.batch.card`: the model card, the push to the Hub, the dry-run plan;
- :mod:`~convert.batch.ray_executor`: each job a Ray task (the ``[ray]`` extra).
"""
