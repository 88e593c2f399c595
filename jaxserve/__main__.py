"""`python -m jaxserve` runs the command line."""

from jaxserve.cli import main

main()
