"""`python -m distill`: the command line."""

from distill.cli import main

main()
