"""convert-bnb's conversion side: kernels, planning, the streaming pipeline, LoRA, Hub and the CLI.

Reads through :mod:`formats`; ``formats`` never imports ``convert``.
"""

__version__ = "0.1.0"
