"""The test suite (a package, so that its modules import ``tests.support.*`` by name).

The repository root is on ``sys.path`` through configuration, not code: pytest's ``pythonpath = .``
(setup.cfg, ``[tool:pytest]``); ranks started with ``spawn``/``forkserver`` inherit the parent's
``sys.path``.
"""
