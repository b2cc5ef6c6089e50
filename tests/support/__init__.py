"""What the tests share, and the benchmarks and ``scripts/experiments/`` reuse; no tests here.

* ``checks``: ``raises_in_checkpoint``, DCP's wrapped exceptions unwrapped.
* ``data``: deterministic tensors by key, comparisons, a checkpoint's files, headers and CRCs.
* ``dist``: ``run_ranks``, a function on several spawned gloo ranks.
* ``jobs``: ``run_job``, ranks that may be killed (forkserver), and how each one ended.
* ``killpoints``, ``killchain``: SIGKILL at the moments of a save, and the chains of kills and
  resumes of ``test_kill.py`` and ``scripts/experiments/kill_matrix.py``.
* ``faultproxy``: an HTTP proxy that injects faults between s3fs and an S3 server.
* ``soak``: seeded saves and loads through the fault proxy (``test_soak.py``,
  ``scripts/experiments/soak_s3.py``).
* ``training``: a tiny FSDP2 training run for the exact-resume tests.
* ``asyncsave``: the state dicts and checks of the async-save tests.
* ``storage_options``: the loopback servers' ``storage_options``, the sealed fake AWS environment,
  fresh buckets (the fixtures in ``tests/conftest.py`` are built on them).
* ``radosgw``, ``objectservers``: Ceph radosgw (``scripts/setup/radosgw.sh``), fake-gcs-server and
  Azurite (``scripts/setup/azurite``) started on 127.0.0.1.
* ``exit_script``: a script, not a module: the training job ``test_exit.py`` runs as real processes.
"""
