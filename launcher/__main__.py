"""``python -m launcher`` is the ``launcher`` command."""

import sys

from launcher.cli.main import main

sys.exit(main())
