"""Chaos: the cluster under many faults at once, and a checker that reads the whole history.

``make chaos SECONDS=120 SEED=7 BROKER=separate`` (or ``python -m harness.chaos run
...``) starts a cluster of real processes on loopback (:mod:`.cluster`), lets a
seeded nemesis inject overlapping faults into it (:mod:`.nemesis`), brings it to
rest, and judges what every process recorded (:mod:`.history`) with the
checker (:mod:`.checker`, :mod:`.model`). ``python -m harness.chaos check DIR``
judges a saved history again. The app under test is :mod:`.app`; the
submitter :mod:`.submitter`; phases :mod:`.run`; figures :mod:`.report`.

Like the rest of :mod:`harness`, nothing here is part of the library.
"""
