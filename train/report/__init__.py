"""Reports of measured runs: the bench's report and advised k, the quickstart's summary, plots."""
