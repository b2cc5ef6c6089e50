"""The checkpoint tools and the ``hf-dcp`` command line: inspect, verify, consolidate, convert (with
key maps), progress reporting, and the argument parsing and printing of ``tools/cli.py``."""
