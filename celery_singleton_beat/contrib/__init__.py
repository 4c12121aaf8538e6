"""Integrations with other beat schedulers, each behind an optional extra.

Nothing here is imported by ``celery_singleton_beat`` itself: a base install
never imports Django or any other integration's dependencies.

* :mod:`celery_singleton_beat.contrib.django`: django-celery-beat's
  ``DatabaseScheduler``, active-active (``pip install 'celery-singleton-beat[django]'``).
* :mod:`celery_singleton_beat.contrib.redbeat`: RedBeat's ``RedBeatScheduler``,
  active-active (``pip install 'celery-singleton-beat[redbeat]'``).
"""
