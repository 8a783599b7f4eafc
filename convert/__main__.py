"""``python -m convert`` runs the ``convert-bnb`` command."""

import sys

from convert import main

sys.exit(main())
