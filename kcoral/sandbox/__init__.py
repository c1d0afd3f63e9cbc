"""The sandbox the broker starts each zygote in: the bubblewrap argv (``bubblewrap.py``) and the
broker's launcher that picks bubblewrap or none per ``--sandbox`` (``launcher.py``)."""
