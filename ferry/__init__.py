"""The ``ferry`` command line and single-machine launcher, on top of every other package."""
