"""`python -m sdq.producer.cli`: the same as the `sdq` console script."""

from sdq.producer.cli.main import main

main()
