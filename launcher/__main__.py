"""``python -m launcher`` is the ``launcher`` command."""

import sys

from launcher.cli import main

sys.exit(main())
