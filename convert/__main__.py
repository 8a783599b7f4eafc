"""``python -m convert`` runs the ``convert-bnb`` command."""

import sys

from .cli import main

sys.exit(main())
