"""`python -m sdq.producer.cli`: the same as the `sdq` console script."""

from sdq.producer.cli.start import main

main()
