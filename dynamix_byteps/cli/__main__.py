"""``python -m dynamix_byteps.cli``: the ``dynamix`` command (the form bpslaunch starts its services with)."""

import sys

from dynamix_byteps.cli import main

sys.exit(main())
