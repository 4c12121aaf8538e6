"""The example shop: a Celery app whose periodic work must run exactly once.

Modules: :mod:`.celery_app` (the app and its settings), :mod:`.schedule` (the
beat schedule), :mod:`.tasks` (the tasks), :mod:`.journal` (the shop's data
store, which also records every execution for the demo) and :mod:`.health`
(container health checks).
"""
