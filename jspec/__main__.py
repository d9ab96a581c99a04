"""`python -m jspec serve|generate`: the server and the command-line generator."""

from jspec.cli import main

main()
