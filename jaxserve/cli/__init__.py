"""The `jaxserve` command line: the group in `main`, one module per command, the shared engine flags."""
