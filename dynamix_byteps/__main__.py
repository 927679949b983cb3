"""``python -m dynamix_byteps``: the ``dynamix`` command."""

import sys

from dynamix_byteps.cli import main

sys.exit(main())
