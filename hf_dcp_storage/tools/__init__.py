"""The checkpoint tools and the ``hf-dcp`` command line: inspect, verify, consolidate, convert (with
key maps), progress reporting, and the command line itself (``tools/cli.py`` parses, the commands
of ``tools/commands.py`` run and print, through ``tools/output.py``)."""
