"""``python -m convert`` runs the ``convert-bnb`` command."""

import sys

from . import main

sys.exit(main())
