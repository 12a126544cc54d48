"""The ``tensorkv`` command line: ``demo``, ``bench``, ``stores`` and the checkpoint tools."""
