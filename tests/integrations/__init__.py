"""The trainer integrations' tests, run in ``.venv-integrations`` (by
``tests/test_integrations.py``)."""
