import os

os.environ.setdefault("TENSORKV_PROGRESS", "0")
