"""`python -m paratrain.cli ...` (what torchrun and the README's direct form run)."""

from paratrain.cli.app import main

main()
