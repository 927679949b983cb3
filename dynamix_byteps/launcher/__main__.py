"""``python -m dynamix_byteps.launcher``: the same as the ``bpslaunch`` command."""

import sys

from dynamix_byteps.launcher.launch import main

sys.exit(main())
