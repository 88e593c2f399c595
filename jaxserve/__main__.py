"""`python -m jaxserve` runs the command line."""

from jaxserve.cli.main import main

main()
