"""A package ``tests.apps.discover_app`` autodiscovers tasks in."""
