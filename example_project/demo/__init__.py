"""The demo: ``python -m example_project.demo`` (what ``make demo`` runs).

Runs the example shop with 3 beats and 2 workers on a Redis of its own,
kills a beat half-way, and counts every execution per schedule slot. See
:mod:`.run` for the sequence and :mod:`.report` for what is counted.
"""
