"""``python -m hf_dcp_storage``: the ``hf-dcp`` command line."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
