"""``python -m flowerbed`` runs the ``flowerbed`` command."""

import sys

from flowerbed.cli import main

sys.exit(main())
