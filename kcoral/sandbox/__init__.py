"""The sandbox each zygote runs in: the bubblewrap command for given paths and device nodes
(``bubblewrap.py``). It imports nothing of KCoral; the broker decides what goes in
(:mod:`kcoral.broker.launch`)."""
