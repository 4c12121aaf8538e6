"""An example shop built on celery-singleton-beat, and a demo that runs it as a cluster.

* :mod:`example_project.shop`: the Celery app (tasks, beat schedule, configuration
  from environment variables), as a user of the library would write it.
* :mod:`example_project.demo`: ``python -m example_project.demo`` (``make demo``)
  runs the app with three beats and two workers and counts every execution.

See ``docs/example.md``.
"""
